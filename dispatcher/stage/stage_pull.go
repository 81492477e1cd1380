package stage

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// takeOverEvery is how often a prefill loop with a free engine slot looks
// for jobs waiting for other engines that cannot take them. A consumer is
// taken from when two looks in a row find jobs in it (never delivered, or
// delivered and not acked: a redelivery waits among those), no pull
// waiting on it, and nothing delivered from it for takeOverAfter: its
// engine is busy with all it can run, or gone. An engine briefly without
// a pull waiting (its decode gate closed for a look, gateFresh, after a
// job it just took) is not taken from. A take-over pull that finds only
// running jobs comes back empty after takeOverWait.
const (
	takeOverEvery = 100 * time.Millisecond
	takeOverAfter = 100 * time.Millisecond
)

// takeOverWait is a take-over pull's wait: the job seen waiting may have
// been taken by its own engine meanwhile, and a pull left waiting on
// another engine's consumer would compete with that engine for its next.
const takeOverWait = 20 * time.Millisecond

// trialYield is how long a pull whose half-open trial came back empty waits
// before it asks for the trial again, so that the loop's pull on another
// consumer gets it: with affinity a loop pulls two, and the trial job may
// come to either.
const trialYield = 20 * time.Millisecond

// orphanLookEvery is how many take-over looks apart a loop looks for jobs
// that prefer an engine without a consumer (see adoptOrphans).
const orphanLookEvery = 10

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
// (see dispatcher.Job.Prefer): a prefill loop of a worker whose engine is
// known, with Config.Affinity.
func (l *Loop) affinity() bool {
	return l.cfg.Affinity && l.cfg.Stage == dispatcher.StagePrefill && l.cfg.Worker.Engine != ""
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
// cannot take them: an engine's consumer that has jobs pending and no
// pull waiting, on two looks in a row, belongs to an engine whose slots
// are all busy, or that is gone (stopped, its breaker open, its worker
// dead). So affinity never leaves this engine idle while work waits.
func (l *Loop) takeOver(ctx, jobCtx context.Context, slots chan struct{}, gate *pull.DecodeGate, keep *pull.Keeper, wg *sync.WaitGroup) {
	own := dispatcher.EngineConsumerName(l.cfg.Stage, l.cfg.Pool, l.engineKey())
	src := &pullSource{from: pulledTakenOver, pulls: pull.NewPuller(ctx, l.nc, l.js, takeOverWait)}
	defer func() {
		for _, msg := range src.pulls.Stop() {
			wg.Go(func() { l.giveBack(context.WithoutCancel(ctx), msg) })
		}
	}()
	t := time.NewTicker(takeOverEvery)
	defer t.Stop()
	stuck := map[string]bool{} // consumers that looked stuck last time
	for tick := 0; ; tick++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if tick%orphanLookEvery == 0 {
			l.adoptOrphans(ctx)
		}
		if l.cfg.EngineSlots != nil {
			if used, limit, _ := l.cfg.EngineSlots.Load(); used >= limit {
				clear(stuck) // nothing to take them with
				continue
			}
		}
		infos, err := dispatcher.EngineConsumers(ctx, l.js, l.cfg.Stage, l.cfg.Pool)
		if err != nil {
			continue // NATS is away: the next look
		}
		next := map[string]bool{}
		for _, info := range infos {
			if info.Name == own || !stuckConsumer(info) {
				continue
			}
			if next[info.Name] = true; !stuck[info.Name] {
				continue
			}
			cons, err := l.js.Consumer(ctx, info.Stream, info.Name)
			if err != nil {
				continue
			}
			src.cons = cons
			src.ensure = func(context.Context) (jetstream.Consumer, error) { return cons, nil }
			for n := 0; n < int(info.NumPending)+info.NumAckPending; n++ {
				took, stop := l.pullOne(ctx, jobCtx, src, slots, gate, keep, wg)
				if stop {
					return
				}
				if !took {
					break
				}
			}
		}
		stuck = next
	}
}

// adoptOrphans gives a consumer to the jobs that prefer an engine which
// has none: an engine that left before it ever pulled, or whose consumer
// was removed as idle. Those jobs would otherwise wait for nobody; with a
// consumer, takeOver takes them like any others of a gone engine.
func (l *Loop) adoptOrphans(ctx context.Context) {
	st, err := l.js.Stream(ctx, dispatcher.StageStream(l.cfg.Stage))
	if err != nil {
		return
	}
	prefix := dispatcher.StageSubject(l.cfg.Stage) + "." + l.cfg.Pool + "."
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(prefix+"*.*"))
	if err != nil || len(info.State.Subjects) == 0 {
		return
	}
	infos, err := dispatcher.EngineConsumers(ctx, l.js, l.cfg.Stage, l.cfg.Pool)
	if err != nil {
		return
	}
	have := map[string]bool{}
	for _, c := range infos {
		have[c.Name] = true
	}
	for subject := range info.State.Subjects {
		engine := subject[strings.LastIndexByte(subject, '.')+1:]
		if !dispatcher.IsEngineKey(engine) {
			continue
		}
		if name := dispatcher.EngineConsumerName(l.cfg.Stage, l.cfg.Pool, engine); !have[name] {
			if _, err := dispatcher.EnsureEngineConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, engine, l.cfg.AckWait, dispatcher.WithLogger(l.log)); err == nil {
				have[name] = true
				l.log.Info("jobs wait for an engine without a consumer; gave it one, to take them over", "engine", engine)
			}
		}
	}
}

// stuckConsumer says whether an engine's consumer has jobs that its engine
// does not take: pending, or delivered and not acked (NumPending does not
// count a job nak'd, or whose ack wait ran out, to be delivered again),
// with no pull waiting and nothing delivered for takeOverAfter (by the
// server's clock).
func stuckConsumer(info *jetstream.ConsumerInfo) bool {
	if info.NumPending == 0 && info.NumAckPending == 0 || info.NumWaiting > 0 {
		return false
	}
	last := info.Created
	if info.Delivered.Last != nil {
		last = *info.Delivered.Last
	}
	return info.TimeStamp.Sub(last) >= takeOverAfter
}
