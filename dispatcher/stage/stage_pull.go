package stage

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// trialYield is how long a pull whose half-open trial came back empty waits
// before it asks for the trial again, so that the loop's pull on another
// consumer gets it: with affinity a loop pulls two, and the trial job may
// come to either.
const trialYield = 20 * time.Millisecond

// pullSource is a consumer a loop pulls from, with its own puller (a
// puller serves one goroutine), and how to find the consumer again after
// a pull fails.
type pullSource struct {
	from   string // for pdq_jobs_pulled_total
	pulls  *pull.Puller
	cons   jetstream.Consumer
	ensure func(context.Context) (jetstream.Consumer, error)
}

// affinity says whether this loop takes the jobs that prefer its engine
// (see dispatcher.Job.Preferred): a loop of a worker whose engine is
// known, with Config.Affinity.
func (l *Loop) affinity() bool {
	return l.cfg.Affinity && l.cfg.Worker.Engine != ""
}

func (l *Loop) engineKey() string { return dispatcher.EngineKey(l.cfg.Worker.Engine) }

// ownSource is the consumer of the jobs that prefer this loop's engine.
func (l *Loop) ownSource(ctx context.Context) (*pullSource, error) {
	ensure := func(ctx context.Context) (jetstream.Consumer, error) {
		return dispatcher.EnsureEngineConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.engineKey(), l.cfg.AckWait, dispatcher.WithLogger(l.log))
	}
	var cons jetstream.Consumer
	err := dispatcher.UntilAnswered(ctx, l.log, "the engine's own consumer", func(ctx context.Context) (err error) {
		cons, err = ensure(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &pullSource{from: pulledPreferred, pulls: pull.NewPuller(ctx, l.nc, l.js, l.cfg.PullWait), cons: cons, ensure: ensure}, nil
}

// pullLoop pulls jobs from src and starts them, one per free slot, until
// ctx ends.
func (l *Loop) pullLoop(ctx, jobCtx context.Context, src *pullSource, slots chan struct{}, gate *pull.DecodeGate, keep *pull.Keeper, wg *sync.WaitGroup) {
	for {
		if _, stop := l.pullOne(ctx, jobCtx, src, slots, gate, keep, wg); stop {
			return
		}
	}
}

// pullOne waits for a free slot, pulls one job from src and starts it. It
// reports whether a job came, and whether the loop is to stop.
func (l *Loop) pullOne(ctx, jobCtx context.Context, src *pullSource, slots chan struct{}, gate *pull.DecodeGate, keep *pull.Keeper, wg *sync.WaitGroup) (took, stop bool) {
	select {
	case slots <- struct{}{}:
	case <-ctx.Done():
		return false, true
	}
	var permit Permit
	if l.cfg.Ready != nil {
		var err error
		if permit, err = l.cfg.Ready(ctx); err != nil {
			<-slots
			return false, true
		}
	}
	if gate != nil && gate.Wait(ctx) != nil || l.cfg.EngineSlots != nil && l.cfg.EngineSlots.WaitFree(ctx) != nil {
		permit.release()
		<-slots
		return false, true
	}
	msg, err := src.pulls.Next(ctx, src.cons)
	if err != nil {
		permit.release()
		<-slots
		if ctx.Err() != nil {
			return false, true
		}
		if errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrNoMessages) {
			if permit.Release != nil && sleep.For(ctx, trialYield) != nil {
				// A half-open breaker's one trial, given back unused: the
				// loop's other pulls (another consumer) take it first.
				return false, true
			}
			return false, false
		}
		l.log.Warn("pull failed; retrying in 1s", "consumer", src.cons.CachedInfo().Name, logging.Err(err))
		if sleep.For(ctx, time.Second) != nil {
			return false, true
		}
		if c, err := src.ensure(ctx); err == nil {
			src.cons = c
		}
		return false, false
	}
	keep.TookJob()
	if gate != nil {
		gate.Took()
	}
	l.cfg.Metrics.pulledFrom(l.cfg.Stage, src.from)
	// The engine slot is taken at once, so that the next turn of the
	// loop sees it gone; losing a race for the last one, the job waits
	// for it in process.
	held := l.cfg.EngineSlots != nil && l.cfg.EngineSlots.TryAcquire()
	l.inFlight.Add(1)
	wg.Go(func() {
		defer func() {
			l.inFlight.Add(-1)
			<-slots
		}()
		l.process(ctx, jobCtx, msg, permit, held)
	})
	return true, false
}

// takeOver takes the jobs that wait for other engines of the pool which
// cannot take them (see pull.TakeOver): their engines' slots are all busy,
// or the engines are gone (stopped, their breaker open, their worker
// dead). So affinity never leaves this engine idle while work waits.
func (l *Loop) takeOver(ctx, jobCtx context.Context, slots chan struct{}, gate *pull.DecodeGate, keep *pull.Keeper, wg *sync.WaitGroup) {
	look := pull.NewTakeOver(l.js, l.queues, l.cfg.Stage, l.cfg.Pool, l.engineKey(), l.cfg.AckWait, l.log)
	src := &pullSource{from: pulledTakenOver, pulls: pull.NewPuller(ctx, l.nc, l.js, pull.TakeOverWait)}
	defer func() {
		for _, msg := range src.pulls.Stop() {
			wg.Go(func() { l.giveBack(context.WithoutCancel(ctx), msg) })
		}
	}()
	// Each report of the pool's queues is read as it comes (News); the
	// timer covers a reporter gone quiet, and a full engine's wait for a
	// free slot.
	t := time.NewTimer(look.Every())
	defer t.Stop()
	news := l.queues.News()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-news:
		}
		news = l.queues.News()
		full := false
		if l.cfg.EngineSlots != nil {
			used, limit, _ := l.cfg.EngineSlots.Load()
			full = used >= limit
		}
		for _, stuck := range look.Look(ctx, full) {
			src.cons = stuck.Consumer
			src.ensure = func(context.Context) (jetstream.Consumer, error) { return stuck.Consumer, nil }
			for range stuck.Jobs {
				took, stop := l.pullOne(ctx, jobCtx, src, slots, gate, keep, wg)
				if stop {
					return
				}
				if !took {
					break
				}
			}
		}
		t.Reset(look.Every())
	}
}
