package workers

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// waitState waits until the breaker is in want.
func waitState(t *testing.T, b *breaker, want dispatcher.BreakerState) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for b.State() != want {
		if time.Now().After(deadline) {
			t.Fatalf("breaker %s, want %s", b.State(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestBreaker walks the breaker through its states against a `pdq sim`
// engine: failures in a row open it, /health half-opens it, one trial at a
// time goes through, an outcome from before the opening counts for
// nothing, and the trial's outcome closes or reopens it.
func TestBreaker(t *testing.T) {
	engine := simtest.Start(t, simtest.FastConfig())
	client, err := vllm.New(engine.URL, 1, "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	b := newBreaker(3, client, dispatcher.StageDecode, nil, logging.Discard())
	b.generate = func(ctx context.Context) error { return client.Generate(ctx, "pdq-sim", "probe-1") }
	failure := errors.New("engine answered 500")

	closed := func() uint64 { return permitToken(b.Epoch(), false) }
	old := closed() // a job pulled while closed
	for range 2 {
		b.failed(ctx, closed(), false, failure)
	}
	if b.State() != dispatcher.BreakerClosed {
		t.Fatalf("after 2 failures: %s, want closed", b.State())
	}
	b.failed(ctx, closed(), false, failure)
	waitState(t, b, dispatcher.BreakerHalfOpen) // /health and a one-token request answer at once

	first, err := b.wait(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	second := make(chan stage.Permit)
	go func() {
		if p, err := b.wait(ctx, nil); err == nil {
			second <- p
		}
	}()
	select {
	case <-second:
		t.Fatal("a second pull went through while the trial was claimed")
	case <-time.After(100 * time.Millisecond):
	}
	first.Release() // the pull got no job: the trial is free again
	first.Release() // twice is once
	var p stage.Permit
	select {
	case p = <-second:
	case <-time.After(2 * time.Second):
		t.Fatal("the trial given back was not taken")
	}

	trial := p.Token
	if b.admits(old) || !b.admits(trial) {
		t.Errorf("half-open: a job pulled before the opening admitted %v, the trial admitted %v; want false, true",
			b.admits(old), b.admits(trial))
	}
	b.neutral(old)   // a job from before the opening frees no trial
	b.succeeded(old) // nor says anything of the engine
	if b.State() != dispatcher.BreakerHalfOpen || !b.trial {
		t.Fatalf("after stale outcomes: %s, trial claimed %v; want half-open with the trial claimed", b.State(), b.trial)
	}
	b.failed(ctx, trial, false, failure)
	if b.State() != dispatcher.BreakerOpen {
		t.Fatalf("after the trial failed: %s, want open", b.State())
	}
	waitState(t, b, dispatcher.BreakerHalfOpen) // probed again after 1 s
	p, err = b.wait(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	b.succeeded(p.Token)
	if b.State() != dispatcher.BreakerClosed {
		t.Fatalf("after the trial succeeded: %s, want closed", b.State())
	}
}

// TestBreakerTrialDroppedUnrun: a half-open breaker's trial pull brings a
// job that is dropped before it runs (its deadline is too near). The trial
// must be given back, or the worker would never pull again.
func TestBreakerTrialDroppedUnrun(t *testing.T) {
	nc := embeddedtest.Conn(t, logging.Discard())
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := dispatcher.Ensure(ctx, js); err != nil {
		t.Fatal(err)
	}
	engine := simtest.Start(t, simtest.FastConfig())
	client, err := vllm.New(engine.URL, 1, "")
	if err != nil {
		t.Fatal(err)
	}
	b := newBreaker(1, client, dispatcher.StagePrefill, nil, logging.Discard())
	b.failed(ctx, permitToken(b.Epoch(), false), false, errors.New("engine answered 500"))
	waitState(t, b, dispatcher.BreakerHalfOpen)

	const pool = "trial"
	var runs atomic.Int64
	loop, err := stage.NewLoop(nc, js, stage.Config{Stage: dispatcher.StagePrefill, Pool: pool, Slots: 1,
		Grace: time.Second, RetryBase: config.RetryBase, PullWait: config.PullWait, AckWait: config.DefaultAckWait,
		KeepEvery: config.KeepEvery, KVTTL: config.DefaultKVTTL, MaxGenerations: config.DefaultMaxGenerations,
		MaxDeliver: config.DefaultMaxDeliver, StallTimeout: config.DefaultStallTimeout,
		Ready: func(ctx context.Context) (stage.Permit, error) { return b.wait(ctx, nil) },
		Handler: func(context.Context, *stage.Delivery) error {
			runs.Add(1)
			return nil
		}}, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { loop.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	submitter := submit.NewSubmitter(js, records, registry.NewLiveness(nc))
	submit := func(id string, life time.Duration) {
		job := &dispatcher.Job{ID: id, Model: "m", Pool: pool, Endpoint: openai.Completions, Body: []byte(`{"prompt":"x"}`),
			Submitted: time.Now(), Deadline: time.Now().Add(life)}
		if _, err := submitter.Submit(ctx, dispatcher.StagePrefill, job); err != nil {
			t.Fatal(err)
		}
	}
	submit("nearly-expired", 50*time.Millisecond) // dropped at pull: under 100 ms left
	time.Sleep(500 * time.Millisecond)
	submit("fresh", time.Minute)
	deadline := time.Now().Add(10 * time.Second)
	for runs.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the fresh job never ran: breaker %s, trial claimed %v", b.State(), b.trial)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestBreakerTrialGivenBackWakes: a half-open breaker's trial given back
// unused (its pull brought no job) goes to a pull that waits for it at
// once, not at its next look half a second later: with affinity a loop
// pulls two consumers, and the trial job may come to the other.
func TestBreakerTrialGivenBackWakes(t *testing.T) {
	engine := simtest.Start(t, simtest.FastConfig())
	client, err := vllm.New(engine.URL, 1, "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	b := newBreaker(1, client, dispatcher.StagePrefill, nil, logging.Discard())
	b.failed(ctx, permitToken(b.Epoch(), false), false, errors.New("engine answered 500"))
	waitState(t, b, dispatcher.BreakerHalfOpen)
	first, err := b.wait(ctx, nil)
	if err != nil || first.Release == nil {
		t.Fatalf("the first pull got %+v, %v; want the trial", first, err)
	}
	got := make(chan time.Time, 1)
	go func() {
		if p, err := b.wait(ctx, nil); err == nil && p.Release != nil {
			got <- time.Now()
		}
	}()
	time.Sleep(50 * time.Millisecond) // the second pull waits
	given := time.Now()
	first.Release()
	select {
	case at := <-got:
		if d := at.Sub(given); d > 350*time.Millisecond { // the next look would be 450 ms on
			t.Errorf("the trial reached the waiting pull %v after it was given back; want at once", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the trial given back never reached the waiting pull")
	}
}
