package stage

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

func runLoop(t *testing.T, l *Loop) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); l.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// TestEngineSlotsReleaseOnCancel: a handoff cancelled while its job waits
// for the engine's only slot is dropped, and its KV release (a decode call
// on the engine) waits for a slot too: the engine never gets more calls
// than its slots. (Found by review: it ran without one.)
func TestEngineSlotsReleaseOnCancel(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	e := pull.NewEngineSlots(1)
	poolA, poolB := dispatcher.PoolName("slots-a"), dispatcher.PoolName("slots-b")
	block := make(chan struct{})
	unblock := sync.OnceFunc(func() { close(block) })
	defer unblock()
	var usedAtRelease atomic.Int32
	usedAtRelease.Store(-1)
	base := Config{Stage: dispatcher.StageDecode, Slots: 1, PullWait: 3 * time.Second, EngineSlots: e, KVTTL: 10 * time.Second,
		AckWait: 2 * time.Second, Grace: time.Second}
	cb := base
	cb.Pool = poolB
	cb.Handler = func(context.Context, *Delivery) error { return nil }
	cb.Release = func(context.Context, *dispatcher.Job) error { usedAtRelease.Store(int32(e.InUse())); return nil }
	lb, _ := NewLoop(nc, js, withSettings(cb), logging.Discard())
	runLoop(t, lb) // idle: passes WaitFree, waits in its pull (for up to 3 s)
	time.Sleep(300 * time.Millisecond)

	ca := base
	ca.Pool = poolA
	ca.Handler = func(context.Context, *Delivery) error { <-block; return nil }
	ca.Release = func(context.Context, *dispatcher.Job) error { return nil }
	la, _ := NewLoop(nc, js, withSettings(ca), logging.Discard())
	runLoop(t, la)
	a := &dispatcher.Job{ID: "slot-a", Model: "a", Pool: poolA, Endpoint: openai.Chat, Body: []byte(`{}`), Deadline: time.Now().Add(time.Minute), Generation: 1}
	if _, err := js.PublishMsg(ctx, a.Msg(dispatcher.StageDecode)); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "a holds the engine", func() bool { return e.InUse() == 1 })

	b := &dispatcher.Job{ID: "slot-b", Model: "b", Pool: poolB, Endpoint: openai.Chat, Body: []byte(`{}`), Deadline: time.Now().Add(time.Minute), Generation: 1,
		KV: []byte(`{"remote_block_ids":[1]}`), Prefill: &dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Generation: 1, Started: time.Now()}}
	if _, err := js.PublishMsg(ctx, b.Msg(dispatcher.StageDecode)); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "b waits for the slot", func() bool { lb.mu.Lock(); defer lb.mu.Unlock(); return len(lb.running) == 1 })
	if err := nc.Publish(dispatcher.CancelSubject("slot-b"), nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if n := usedAtRelease.Load(); n >= 0 {
		t.Fatalf("KV release (a decode call) ran while another model's job held the engine's only slot (%d in use)", n)
	}
	unblock()
	dispatchertest.WaitFor(t, "b's KV released", func() bool { return usedAtRelease.Load() >= 0 })
	if n := usedAtRelease.Load(); n != 1 {
		t.Errorf("KV release ran with %d engine slots in use, want its own", n)
	}
}

// TestEngineSlotsReleaseAfterReject: the KV release of a handoff the
// decode engine rejected runs in an engine slot, though the job gave its
// slot back when the handler returned.
func TestEngineSlotsReleaseAfterReject(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	e := pull.NewEngineSlots(1)
	var usedAtRelease atomic.Int32
	usedAtRelease.Store(-1)
	cfg := Config{Stage: dispatcher.StageDecode, Pool: dispatcher.PoolName("slots-r"), Slots: 1, PullWait: 100 * time.Millisecond, EngineSlots: e, KVTTL: 10 * time.Second,
		AckWait: 2 * time.Second, Grace: time.Second,
		Handler: func(context.Context, *Delivery) error {
			return verdict.Rejected(errors.New("400"), openai.NewError(400, "bad"))
		},
		Release: func(context.Context, *dispatcher.Job) error { usedAtRelease.Store(int32(e.InUse())); return nil }}
	l, _ := NewLoop(nc, js, withSettings(cfg), logging.Discard())
	runLoop(t, l)
	j := &dispatcher.Job{ID: "slot-r", Model: "r", Pool: cfg.Pool, Endpoint: openai.Chat, Body: []byte(`{}`), Deadline: time.Now().Add(time.Minute), Generation: 1,
		KV: []byte(`{"remote_block_ids":[1]}`), Prefill: &dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Generation: 1, Started: time.Now()}}
	if _, err := js.PublishMsg(context.Background(), j.Msg(dispatcher.StageDecode)); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "released", func() bool { return usedAtRelease.Load() >= 0 })
	if usedAtRelease.Load() == 0 {
		t.Errorf("the rejected decode's KV release ran with no engine slot held")
	}
}

// TestEngineSlotsNoOverPull: a loop of a shared engine with one free slot
// pulls one job, not more: jobs it cannot run stay in the queue for other
// workers. (Found by review.)
func TestEngineSlotsNoOverPull(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	e := pull.NewEngineSlots(4)
	for range 3 { // another model's jobs hold 3 of the 4 slots
		e.Acquire(ctx)
	}
	block := make(chan struct{})
	defer close(block)
	var started atomic.Int32
	cfg := Config{Stage: dispatcher.StageDecode, Pool: dispatcher.PoolName("slots-o"), Slots: 4, PullWait: 100 * time.Millisecond, EngineSlots: e, KVTTL: 10 * time.Second,
		AckWait: 5 * time.Second, Grace: time.Second,
		Handler: func(context.Context, *Delivery) error { started.Add(1); <-block; return nil },
		Release: func(context.Context, *dispatcher.Job) error { return nil }}
	big := []byte(`{"x":"` + strings.Repeat("a", 10) + `"}`)
	for i := range 4 {
		j := &dispatcher.Job{ID: "slot-o" + string(rune('0'+i)), Model: "o", Pool: cfg.Pool, Endpoint: openai.Chat, Body: big, Deadline: time.Now().Add(time.Minute), Generation: 1}
		if _, err := js.PublishMsg(ctx, j.Msg(dispatcher.StageDecode)); err != nil {
			t.Fatal(err)
		}
	}
	l, _ := NewLoop(nc, js, withSettings(cfg), logging.Discard())
	runLoop(t, l)
	dispatchertest.WaitFor(t, "one runs", func() bool { return started.Load() == 1 })
	time.Sleep(500 * time.Millisecond)
	l.mu.Lock()
	n := len(l.running)
	l.mu.Unlock()
	if n > 1 {
		t.Errorf("with one free engine slot the loop holds %d pulled jobs (%d running); %d wait for the slot in this worker", n, started.Load(), n-1)
	}
}

// TestEngineSlotsRedeliveryKeepsCount: a redelivered handoff (its KV may
// have been read by the first delivery) that waits for the engine slot
// when its loop stops goes back as it is, counted: the next worker
// regenerates it instead of decoding it. (Found by review: it was handed
// back as a fresh message, and decoded.)
func TestEngineSlotsRedeliveryKeepsCount(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName("slots-h")
	var ran atomic.Int32
	cfg := Config{Stage: dispatcher.StageDecode, Pool: pool, Slots: 1, PullWait: 3 * time.Second, KVTTL: 20 * time.Second, AckWait: time.Second, Grace: time.Second,
		Handler: func(context.Context, *Delivery) error { ran.Add(1); return nil },
		Release: func(context.Context, *dispatcher.Job) error { return nil }}
	cons, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, pool, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	j := &dispatcher.Job{ID: "slot-h", Model: "h", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), Deadline: time.Now().Add(time.Minute), Generation: 1,
		KV: []byte(`{"remote_block_ids":[1]}`), Prefill: &dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Generation: 1, Started: time.Now()}}
	if _, err := js.PublishMsg(ctx, j.Msg(dispatcher.StageDecode)); err != nil {
		t.Fatal(err)
	}
	if _, err := cons.Next(); err != nil { // delivery 1: a worker that read the KV, then went silent
		t.Fatal(err)
	}
	e := pull.NewEngineSlots(1)
	c1 := cfg
	c1.EngineSlots = e
	l1, _ := NewLoop(nc, js, withSettings(c1), logging.Discard())
	ctx1, cancel1 := context.WithCancel(ctx)
	done1 := make(chan struct{})
	go func() { defer close(done1); l1.Run(ctx1) }()
	time.Sleep(200 * time.Millisecond) // l1 waits in its pull (for up to 3 s)
	e.Acquire(ctx)                     // another model's job takes the engine
	dispatchertest.WaitFor(t, "delivery 2 waits for the slot", func() bool { l1.mu.Lock(); defer l1.mu.Unlock(); return len(l1.running) == 1 })
	cancel1()
	<-done1

	c2 := cfg
	c2.EngineSlots = pull.NewEngineSlots(1)
	l2, _ := NewLoop(nc, js, withSettings(c2), logging.Discard())
	runLoop(t, l2)
	time.Sleep(2 * time.Second)
	if ran.Load() > 0 {
		t.Errorf("a redelivered handoff was decoded after a hand-back (KV possibly read twice): ran %d", ran.Load())
	}
}

// TestEngineSlotsBusyEngine: a loop whose engine is full (another model's
// job holds its only slot) pulls nothing, so a handoff waits in the queue
// for a worker with a free engine, which decodes it: its KV unread, not
// prefilled again. (Review: a pulled job used to wait in the busy worker,
// and was Naked into a new generation when that loop stopped.)
func TestEngineSlotsBusyEngine(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	id := "slot-wait"
	var ran, released, handBacks atomic.Int32
	cfg := Config{Stage: dispatcher.StageDecode, Pool: pool, Slots: 1, PullWait: 100 * time.Millisecond, KVTTL: 10 * time.Second, AckWait: 300 * time.Millisecond,
		Grace: time.Second,
		Handler: func(_ context.Context, d *Delivery) error {
			ran.Add(1)
			handBacks.Store(int32(d.Job.HandBacks))
			return nil
		},
		Release: func(context.Context, *dispatcher.Job) error { released.Add(1); return nil }}
	records, _ := dispatcher.OpenRecords(ctx, js)
	job := &dispatcher.Job{ID: id, Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), Deadline: time.Now().Add(time.Minute)}
	if _, err := submit.NewSubmitter(js, records, registry.NewLiveness(nc)).Submit(ctx, dispatcher.StagePrefill, job); err != nil {
		t.Fatal(err)
	}
	pcons, _ := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Second)
	pm, err := pcons.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	job.KV = []byte(`{"remote_block_ids":[1]}`)
	job.Prefill = &dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Generation: 1, Started: time.Now()}
	if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
		t.Fatal(err)
	}
	pm.Ack()

	// Worker 1: its engine is full (another model's job holds the slot).
	full := pull.NewEngineSlots(1)
	if err := full.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	c1 := cfg
	c1.EngineSlots = full
	l1, _ := NewLoop(nc, js, withSettings(c1), logging.Discard())
	ctx1, cancel1 := context.WithCancel(ctx)
	done1 := make(chan struct{})
	go func() { defer close(done1); l1.Run(ctx1) }()
	time.Sleep(time.Second) // long enough to pull the handoff, were it to
	cancel1()
	<-done1

	// Worker 2: an idle engine.
	c2 := cfg
	c2.EngineSlots = pull.NewEngineSlots(1)
	l2, _ := NewLoop(nc, js, withSettings(c2), logging.Discard())
	ctx2, cancel2 := context.WithCancel(ctx)
	done2 := make(chan struct{})
	go func() { defer close(done2); l2.Run(ctx2) }()
	defer func() { cancel2(); <-done2 }()
	dispatchertest.WaitFor(t, "the handoff settled", func() bool {
		r, _, _ := records.Get(ctx, id)
		return ran.Load() > 0 || r.Generation > 1
	})
	if r, _, _ := records.Get(ctx, id); ran.Load() != 1 || r.Generation != 1 {
		t.Errorf("the unread handoff was not decoded: record generation %d state %s, decode ran %d times", r.Generation, r.State, ran.Load())
	}
	if n := handBacks.Load(); n != 0 {
		t.Errorf("the handoff was handed back %d times: the busy worker pulled it", n)
	}
}

// TestJobDurations: the average is not reported until avgWarmup jobs
// finished, so one short first job (a readiness probe) does not stand for
// them all; then it follows the jobs.
func TestJobDurations(t *testing.T) {
	var j jobDurations
	j.add(4 * time.Millisecond)
	for range avgWarmup - 2 {
		j.add(300 * time.Millisecond)
		if got := j.avgMs(); got != 0 {
			t.Fatalf("reported %v ms before %d jobs", got, avgWarmup)
		}
	}
	j.add(300 * time.Millisecond)
	if got, want := j.avgMs(), (4+300*(avgWarmup-1))/float64(avgWarmup); got != want {
		t.Errorf("after %d jobs: %v ms, want their mean %v", avgWarmup, got, want)
	}
	for range 40 {
		j.add(time.Second)
	}
	if got := j.avgMs(); got < 990 || got > 1000 {
		t.Errorf("after 40 jobs of 1 s: %v ms, want about 1000", got)
	}
}
