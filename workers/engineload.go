package workers

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// Engine load: a worker gives its engine no more jobs than the engine
// starts. An engine given more queues them where no one else sees them: a
// handoff queued in a decode engine is out of the decode gate's sight, so
// the prefill stage keeps prefilling for a backlog it cannot see, and
// those handoffs age past PDQ_KV_TTL in JetStream (prefilled again) while
// their KV expires unread on the prefill engine; and a prefill queued in
// one engine cannot be taken by an idle one. PDQ_ENGINE_SLOTS cannot say
// this: what an engine starts depends on its --max-num-seqs, its KV room
// and its prompts, and vLLM tells it on /metrics.
const (
	// loadEvery is how often a busy worker reads its engine's load.
	loadEvery = 250 * time.Millisecond
	// loadRetry is how long a worker whose engine does not report its
	// load waits before it asks again.
	loadRetry = time.Minute
	// firstSlots are the slots a worker starts from once its engine
	// reports its load; they double each look that finds the engine
	// keeping up (a cold burst queues little in any engine), up to
	// PDQ_ENGINE_SLOTS.
	firstSlots = 4
	// loadFailuresTold is how many failed looks in a row make a WARN.
	loadFailuresTold = 20
)

// slotPolicy decides an engine's slots, and the seats to report for it,
// from its load, look after look.
//
// vLLM counts as waiting both the requests that wait for a seat and the
// decodes that wait a moment for their KV to arrive, so a few waiting
// requests say nothing: an engine is full only while more wait than an
// eighth of those running (at least one), on two looks in a row. A full
// engine's seats are the most it ran in those looks, and it gets them and
// an eighth more (at least one): what it runs is the most it can, and the
// decodes waiting for their KV cannot walk the slots down one by one. An
// engine with nothing waiting and every slot taken gets twice as many
// slots, up to PDQ_ENGINE_SLOTS; in between, the slots stay. Its seats are
// then the most it was seen to run since it was last full: the decode gate
// counts on them, and slots given on trial are not seats.
type slotPolicy struct {
	fullLooks int // looks in a row that found the engine full
	fullMax   int // the most it ran in those looks
	seats     int // what it runs at once, as far as seen
}

// next returns the slots to give the engine and its seats, from its load
// and the slots used, there now and at most.
func (p *slotPolicy) next(l vllm.Load, used, slots, most int) (next, seats int) {
	if l.Waiting > max(1, l.Running/8) {
		p.fullLooks++
		p.fullMax = max(p.fullMax, l.Running)
		if p.fullLooks >= 2 {
			p.seats = max(1, p.fullMax)
			slots = max(1, min(slots, p.seats+max(1, p.seats/8)))
		}
	} else {
		p.fullLooks, p.fullMax = 0, 0
		p.seats = max(p.seats, l.Running)
		if l.Waiting == 0 && used >= slots {
			slots = min(most, 2*slots)
		}
	}
	return slots, min(max(1, p.seats), slots)
}

// followLoad keeps the worker's engine slots at what the engine starts,
// until ctx ends; it closes looked after its first look, which the worker
// waits for before it pulls. An engine that does not report its load (no
// vLLM /metrics) gets PDQ_ENGINE_SLOTS.
func (w *Worker) followLoad(ctx context.Context, looked chan<- struct{}) {
	f := loadFollower{w: w}
	wait := f.look(ctx)
	close(looked)
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		t.Reset(f.look(ctx))
	}
}

// loadFollower is what followLoad knows between its looks.
type loadFollower struct {
	w      *Worker
	policy slotPolicy
	// known: the engine reported its load last time; told: the log said
	// that it does not; failed counts the failed looks in a row.
	known, told bool
	failed      int
}

// look reads the engine's load, sets its slots, and returns when to look
// again.
func (f *loadFollower) look(ctx context.Context) time.Duration {
	w := f.w
	used, slots, most := w.slots.Load()
	if f.known && 2*used < slots && f.policy.fullLooks == 0 {
		// Most slots free, and the engine not full when last seen:
		// nothing to learn that would change the slots, and a look
		// costs a /metrics.
		return loadEvery
	}
	lctx, cancel := context.WithTimeout(ctx, 4*loadEvery)
	load, err := w.engine.Load(lctx)
	cancel()
	switch {
	case err == nil:
	case ctx.Err() != nil:
		return loadEvery
	case errors.Is(err, vllm.ErrNoLoad):
		if !f.told {
			w.log.Info("the engine does not report its load; it gets PDQ_ENGINE_SLOTS jobs at once", "slots", most, logging.Err(err))
			f.told = true
		}
		f.known, f.failed = false, 0
		w.slots.SetLimit(most, 0)
		w.cfg.EngineMetrics.EngineSlots(w.cfg.Role, w.engine.URL(), most)
		return loadRetry
	default:
		// The engine is down or slow: its breaker deals with that; the
		// slots stay as they are.
		f.failed++
		level := slog.LevelDebug
		if f.failed == loadFailuresTold {
			level = slog.LevelWarn
		}
		w.log.Log(ctx, level, "engine load not read; its slots stay", "slots", slots, "failed_looks", f.failed, logging.Err(err))
		if !f.known {
			return loadRetry / 12
		}
		return loadEvery
	}
	f.failed = 0
	if !f.known {
		f.known = true
		slots = min(most, firstSlots)
		w.log.Info("engine slots follow the engine's load", "first", slots, "most", most)
	}
	next, seats := f.policy.next(load, used, slots, most)
	if next != slots {
		w.log.Debug("engine slots", "slots", next, "was", slots, "seats", seats, "running", load.Running, "waiting", load.Waiting, "used", used)
	}
	w.slots.SetLimit(next, seats)
	w.cfg.EngineMetrics.EngineSlots(w.cfg.Role, w.engine.URL(), next)
	if next > slots {
		// Growing, from few slots under a burst: the next doubling is
		// soon, so that requests do not queue behind slots the engine
		// has room for.
		return loadEvery / 5
	}
	return loadEvery
}
