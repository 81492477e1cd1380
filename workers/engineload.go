package workers

import (
	"context"
	"errors"
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
)

// nextSlots decides the engine's slots from its load, given the slots used
// and there now and at most. An engine that makes requests wait is full:
// it gets what it runs and an eighth more (at least one), for requests
// that wait only a moment (a decode waits for its KV to arrive). An engine
// that keeps up with every slot taken gets twice as many.
func nextSlots(l vllm.Load, used, slots, most int) int {
	switch {
	case l.Waiting > 0:
		return max(1, min(slots, l.Running+max(1, l.Running/8)))
	case used >= slots:
		return min(most, 2*slots)
	}
	return slots
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
	w *Worker
	// known: the engine reported its load last time; told: the log said
	// that it does not.
	known, told bool
}

// look reads the engine's load, sets its slots, and returns when to look
// again.
func (f *loadFollower) look(ctx context.Context) time.Duration {
	w := f.w
	used, slots, most := w.slots.Load()
	if f.known && used == 0 {
		return loadEvery // idle: nothing to learn
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
			w.log.Info("the engine does not report its load; it gets PDQ_ENGINE_SLOTS jobs at once", "slots", most)
			f.told = true
		}
		f.known = false
		w.slots.SetLimit(most, 0)
		w.cfg.Metrics.EngineSlots(w.cfg.Role, w.engine.URL(), most)
		return loadRetry
	default:
		w.log.Debug("engine load not read; its slots stay", "slots", slots, logging.Err(err))
		return loadEvery
	}
	if !f.known {
		f.known = true
		slots = min(most, firstSlots)
		w.log.Info("engine slots follow the engine's load", "first", slots, "most", most)
	}
	next := nextSlots(load, used, slots, most)
	if next != slots {
		w.log.Debug("engine slots", "slots", next, "was", slots, "running", load.Running, "waiting", load.Waiting, "used", used)
	}
	seats := 0 // not full: as many as it is given
	if load.Waiting > 0 {
		seats = load.Running
	}
	w.slots.SetLimit(next, seats)
	w.cfg.Metrics.EngineSlots(w.cfg.Role, w.engine.URL(), next)
	return loadEvery
}
