package workers

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// breaker is a worker's circuit breaker on its engine. Closed, the worker
// pulls as usual. After threshold consecutive failures (transport errors,
// 5xx, stage time-outs), or at once when the engine is unreachable and its
// /health does not answer either, it opens: the worker pulls nothing and
// probes /health with back-off. When the engine answers, the breaker is
// half-open: one job goes through, and its outcome closes or reopens it.
// Jobs already running finish or fail on their own.
//
// Every method may be called from any goroutine, any number at once: the
// stage loops' pull goroutines (wait), their job goroutines (admits,
// succeeded, neutral, failed), either (Open, a permit's Release), the
// heartbeats (Health). An opening starts probe in a goroutine of its own.
type breaker struct {
	// Set by newBreaker (generate and life by Worker.Run, before the
	// first pull), read without a lock.
	threshold int
	engine    *vllm.Client
	stage     dispatcher.Stage
	metrics   *Metrics
	log       *slog.Logger
	// generate, when set, asks the engine for one token: a probe must get
	// an answer, not only /health.
	generate func(ctx context.Context) error
	// life bounds the probes: they end with the worker.
	life context.Context

	// mu guards the fields below. No engine call is made under it.
	mu    sync.Mutex
	state dispatcher.BreakerState
	fails int
	trial bool // a half-open trial job is running
	// retrials counts the trials that failed in a row: each doubles the
	// wait before the next, since an engine can answer /health and still
	// hang every request.
	retrials int
	changed  chan struct{} // closed and replaced at every change of state
	// freed is closed and replaced when a trial is given back unused, so
	// that the loop's other pulls waiting for it look at once.
	freed chan struct{}
	// epoch counts the changes of state. A job's outcome counts only in the
	// state it started in: a job that began before the breaker opened says
	// nothing of a trial, which alone decides a half-open breaker.
	epoch uint64
}

func newBreaker(threshold int, engine *vllm.Client, stage dispatcher.Stage, metrics *Metrics, log *slog.Logger) *breaker {
	metrics.EngineUp(stage, engine.URL(), dispatcher.BreakerClosed)
	return &breaker{threshold: threshold, engine: engine, stage: stage, metrics: metrics, log: log,
		state: dispatcher.BreakerClosed, changed: make(chan struct{}), freed: make(chan struct{}), life: context.Background()}
}

// State is the breaker's state, for the registry.
func (b *breaker) State() dispatcher.BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state
}

// Health is the breaker's state and a channel closed at its next change,
// for the worker's heartbeats.
func (b *breaker) Health() (dispatcher.BreakerState, <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state, b.changed
}

// admits reports whether a job pulled under the permit token may run on
// the engine: the breaker is closed, or half-open and this is its trial.
// A job whose pull was granted before the breaker opened is not: it came
// in late, with the engine already judged sick.
func (b *breaker) admits(tok uint64) bool {
	epoch, trial := fromToken(tok)
	b.mu.Lock()
	defer b.mu.Unlock()
	switch b.state {
	case dispatcher.BreakerClosed:
		return true
	case dispatcher.BreakerHalfOpen:
		return trial && epoch == b.epoch
	}
	return false
}

// Open reports whether the breaker is open.
func (b *breaker) Open() bool { return b.State() == dispatcher.BreakerOpen }

// set changes the state and wakes the waiters; b.mu is held.
func (b *breaker) set(s dispatcher.BreakerState) {
	if b.state == s {
		return
	}
	b.state = s
	b.epoch++
	b.metrics.EngineUp(b.stage, b.engine.URL(), s)
	close(b.changed)
	b.changed = make(chan struct{})
}

// Epoch is the breaker's epoch, taken when a job starts and handed back
// with its outcome.
func (b *breaker) Epoch() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.epoch
}

// A permit's token says in which epoch its pull was granted, and whether
// it holds the half-open breaker's trial: a job's outcome counts only in
// the state its pull was granted in, and only the trial's frees the trial.
func permitToken(epoch uint64, trial bool) uint64 {
	if trial {
		return epoch<<1 | 1
	}
	return epoch << 1
}

func fromToken(tok uint64) (epoch uint64, trial bool) { return tok >> 1, tok&1 == 1 }

// stale reports whether an outcome from a job pulled in epoch is to be
// ignored: the breaker has opened since. b.mu is held.
func (b *breaker) stale(epoch uint64) bool {
	return epoch != b.epoch && b.state != dispatcher.BreakerClosed
}

// succeeded records a job the engine served: the breaker closes.
func (b *breaker) succeeded(tok uint64) {
	epoch, _ := fromToken(tok)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stale(epoch) {
		return
	}
	b.fails, b.trial, b.retrials = 0, false, 0
	if b.state != dispatcher.BreakerClosed {
		b.log.Info("engine healthy again: pulling jobs", "breaker", string(dispatcher.BreakerClosed))
		b.set(dispatcher.BreakerClosed)
	}
}

// neutral records a job that says nothing of the engine's health (a client
// that left, a request the engine refused): a trial is given back.
func (b *breaker) neutral(tok uint64) {
	epoch, trial := fromToken(tok)
	b.mu.Lock()
	defer b.mu.Unlock()
	if trial && !b.stale(epoch) {
		b.trial = false
	}
}

// failed records an engine failure. unreachable means no answer at all:
// then one failed /health probe is enough to open at once, so that a dead
// engine costs its first request nothing more than a probe.
func (b *breaker) failed(ctx context.Context, tok uint64, unreachable bool, cause error) {
	epoch, trial := fromToken(tok)
	b.mu.Lock()
	if b.stale(epoch) {
		b.mu.Unlock()
		return
	}
	b.fails++
	open := b.state == dispatcher.BreakerHalfOpen || b.fails >= b.threshold
	b.mu.Unlock()
	if !open && unreachable {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		open = b.engine.Health(pctx) != nil
		cancel()
	}
	if !open {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stale(epoch) { // the state moved on during the /health probe
		return
	}
	if trial {
		b.retrials++
		b.trial = false
	}
	if b.state == dispatcher.BreakerOpen {
		return
	}
	b.set(dispatcher.BreakerOpen)
	b.metrics.BreakerOpened(b.stage)
	b.log.Warn("engine failing: breaker open, pulling nothing until /health answers",
		"failures", b.fails, logging.Err(cause))
	go b.probe(b.life, trialWait(b.retrials))
}

// probeTimeout bounds a one-token probe of an engine that hung before.
const probeTimeout = 5 * time.Second

// trialWait is the pause before probing again after failed trials: none
// after the first opening, then 1 s, 2 s, 4 s... up to 30 s.
func trialWait(failedTrials int) time.Duration {
	if failedTrials == 0 {
		return 0
	}
	return min(time.Second<<min(failedTrials-1, 5), 30*time.Second)
}

// probe waits, then asks /health and for one token, with back-off, until
// the engine answers both; then it lets one trial job through.
func (b *breaker) probe(ctx context.Context, wait time.Duration) {
	t := time.NewTimer(wait)
	select {
	case <-t.C:
	case <-ctx.Done():
		t.Stop()
		return
	}
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
	// A probe asks for one token too: an engine can answer /health and
	// hang every request, and the trial that follows the probe is some
	// client's request.
	deep := b.generate != nil
	_ = backoff.RetryNotify(func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if err := b.engine.Health(pctx); err != nil || !deep {
			return err
		}
		gctx, cancel := context.WithTimeout(ctx, probeTimeout)
		defer cancel()
		return b.generate(gctx)
	}, backoff.WithContext(bo, ctx), func(err error, next time.Duration) {
		b.log.Debug("engine probe failed", logging.Err(err), "deep", deep, "retry_in", next.Round(time.Millisecond).String())
	})
	if ctx.Err() != nil {
		return // the worker stopped
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == dispatcher.BreakerOpen {
		b.log.Info("engine answers /health: letting one job through", "breaker", string(dispatcher.BreakerHalfOpen))
		b.set(dispatcher.BreakerHalfOpen)
	}
}

// wait returns when a job may be pulled: the breaker is closed, or it is
// half-open and this pull takes the trial. bypass, when it returns true,
// lets an open breaker's worker pull anyway (see Worker.alone). The
// permit's Release gives a trial back when the pull got no job, or the job
// never reached the handler.
func (b *breaker) wait(ctx context.Context, bypass func() bool) (stage.Permit, error) {
	for {
		b.mu.Lock()
		state, changed, freed, epoch := b.state, b.changed, b.freed, b.epoch
		switch {
		case state == dispatcher.BreakerClosed:
			b.mu.Unlock()
			return stage.Permit{Token: permitToken(epoch, false)}, nil
		case state == dispatcher.BreakerHalfOpen && !b.trial:
			b.trial = true
			b.mu.Unlock()
			var once sync.Once
			return stage.Permit{Token: permitToken(epoch, true), Release: func() {
				once.Do(func() { b.unclaim(epoch) })
			}}, nil
		}
		b.mu.Unlock()
		if state == dispatcher.BreakerOpen && bypass != nil && bypass() {
			return stage.Permit{Token: permitToken(epoch, false)}, nil
		}
		// Woken by a change of state; the bypass is looked at again now
		// and then, as peers come and go.
		t := time.NewTimer(500 * time.Millisecond)
		select {
		case <-changed:
		case <-freed:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return stage.Permit{}, ctx.Err()
		}
		t.Stop()
	}
}

// unclaim gives back the trial claimed in epoch, if it is still that one.
func (b *breaker) unclaim(epoch uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.epoch == epoch && b.state == dispatcher.BreakerHalfOpen && b.trial {
		b.trial = false
		close(b.freed)
		b.freed = make(chan struct{})
	}
}
