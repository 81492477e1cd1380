package workers

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// DefaultBreakerFailures is how many consecutive engine failures open a
// breaker (PDQ_BREAKER_FAILURES).
const DefaultBreakerFailures = 3

// breaker is a worker's circuit breaker on its engine. Closed, the worker
// pulls as usual. After threshold consecutive failures (transport errors,
// 5xx, stage time-outs), or at once when the engine is unreachable and its
// /health does not answer either, it opens: the worker pulls nothing and
// probes /health with back-off. When the engine answers, the breaker is
// half-open: one job goes through, and its outcome closes or reopens it.
// Jobs already running finish or fail on their own.
type breaker struct {
	threshold int
	engine    *vllm.Client
	stage     dispatcher.Stage
	metrics   *dispatcher.Metrics
	log       *slog.Logger

	mu    sync.Mutex
	state dispatcher.BreakerState
	fails int
	trial bool // a half-open trial job is running
	// retrials counts the trials that failed in a row: each doubles the
	// wait before the next, since an engine can answer /health and still
	// hang every request.
	retrials int
	changed  chan struct{} // closed and replaced at every change of state
}

func newBreaker(threshold int, engine *vllm.Client, stage dispatcher.Stage, metrics *dispatcher.Metrics, log *slog.Logger) *breaker {
	return &breaker{threshold: threshold, engine: engine, stage: stage, metrics: metrics, log: log,
		state: dispatcher.BreakerClosed, changed: make(chan struct{})}
}

// State is the breaker's state, for the registry.
func (b *breaker) State() dispatcher.BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state
}

// Open reports whether the breaker is open.
func (b *breaker) Open() bool { return b.State() == dispatcher.BreakerOpen }

// set changes the state and wakes the waiters; b.mu is held.
func (b *breaker) set(s dispatcher.BreakerState) {
	if b.state == s {
		return
	}
	b.state = s
	close(b.changed)
	b.changed = make(chan struct{})
}

// succeeded records a job the engine served: the breaker closes.
func (b *breaker) succeeded() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fails, b.trial, b.retrials = 0, false, 0
	if b.state != dispatcher.BreakerClosed {
		b.log.Info("engine healthy again: pulling jobs", "breaker", string(dispatcher.BreakerClosed))
		b.set(dispatcher.BreakerClosed)
	}
}

// neutral records a job that says nothing of the engine's health (a client
// that left, a request the engine refused): a trial slot is given back.
func (b *breaker) neutral() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.trial = false
}

// failed records an engine failure. unreachable means no answer at all:
// then one failed /health probe is enough to open at once, so that a dead
// engine costs its first request nothing more than a probe.
func (b *breaker) failed(ctx context.Context, unreachable bool, cause error) {
	b.mu.Lock()
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
	if b.state == dispatcher.BreakerHalfOpen && b.trial {
		b.retrials++
	}
	b.trial = false
	if b.state == dispatcher.BreakerOpen {
		return
	}
	b.set(dispatcher.BreakerOpen)
	b.metrics.BreakerOpened(b.stage)
	b.log.Warn("engine failing: breaker open, pulling nothing until /health answers",
		"failures", b.fails, logging.Err(cause))
	go b.probe(context.WithoutCancel(ctx), trialWait(b.retrials))
}

// trialWait is the pause before probing again after failed trials: none
// after the first opening, then 1 s, 2 s, 4 s... up to 30 s.
func trialWait(failedTrials int) time.Duration {
	if failedTrials == 0 {
		return 0
	}
	return min(time.Second<<min(failedTrials-1, 5), 30*time.Second)
}

// probe waits, then asks /health with back-off until the engine answers,
// then lets one trial job through.
func (b *breaker) probe(ctx context.Context, wait time.Duration) {
	time.Sleep(wait)
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
	_ = backoff.Retry(func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return b.engine.Health(pctx)
	}, backoff.WithContext(bo, ctx))
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == dispatcher.BreakerOpen {
		b.log.Info("engine answers /health: letting one job through", "breaker", string(dispatcher.BreakerHalfOpen))
		b.set(dispatcher.BreakerHalfOpen)
	}
}

// wait returns when a job may be pulled: the breaker is closed, or it is
// half-open and this pull takes the trial. bypass, when it returns true,
// lets an open breaker's worker pull anyway (to forward jobs decode-only).
func (b *breaker) wait(ctx context.Context, bypass func() bool) error {
	for {
		b.mu.Lock()
		state, changed := b.state, b.changed
		switch {
		case state == dispatcher.BreakerClosed:
			b.mu.Unlock()
			return nil
		case state == dispatcher.BreakerHalfOpen && !b.trial:
			b.trial = true
			b.mu.Unlock()
			return nil
		}
		b.mu.Unlock()
		if state == dispatcher.BreakerOpen && bypass != nil && bypass() {
			return nil
		}
		// Woken by a change of state; the bypass is looked at again now
		// and then, as peers come and go.
		t := time.NewTimer(500 * time.Millisecond)
		select {
		case <-changed:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
		t.Stop()
	}
}
