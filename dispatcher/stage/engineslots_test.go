package stage

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

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
	full := NewEngineSlots(1)
	if err := full.acquire(ctx); err != nil {
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
	c2.EngineSlots = NewEngineSlots(1)
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

func TestEngineSlotsWait(t *testing.T) {
	ctx := context.Background()
	e := NewEngineSlots(2)
	for range 2 {
		if err := e.acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if e.waitFree(short) == nil {
		t.Fatal("a full engine looked free")
	}
	got := make(chan error, 1)
	go func() { got <- e.acquire(ctx) }()
	e.Release()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a freed slot was not taken")
	}
	e.Release()
	if err := e.waitFree(ctx); err != nil {
		t.Fatal(err)
	}
	if e.used != 1 {
		t.Errorf("waitFree took a slot: %d used", e.used)
	}
}

// TestEngineSlotsLimit: a lowered limit lets the jobs running beyond it
// finish but starts none until fewer run; a raised one wakes the jobs that
// wait at once; the limit stays within 1 and the slots made; the seats
// reported are never more than the limit.
func TestEngineSlotsLimit(t *testing.T) {
	ctx := context.Background()
	e := NewEngineSlots(4)
	for range 3 {
		if !e.TryAcquire() {
			t.Fatal("a free slot refused")
		}
	}
	e.SetLimit(2, 1)
	if used, limit, most := e.Load(); used != 3 || limit != 2 || most != 4 || e.Seats() != 1 {
		t.Errorf("Load() = %d, %d, %d, seats %d; want 3, 2, 4 and 1", used, limit, most, e.Seats())
	}
	e.Release()
	if e.TryAcquire() {
		t.Fatal("a slot taken at the limit")
	}
	got := make(chan error, 1)
	go func() { got <- e.acquire(ctx) }()
	select {
	case err := <-got:
		t.Fatalf("a slot taken at the limit: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	e.SetLimit(3, 0)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a raised limit did not wake the job waiting for a slot")
	}
	for _, tc := range []struct{ n, seats, limit, wantSeats int }{
		{0, 0, 1, 1},
		{99, 0, 4, 4},
		{3, 7, 3, 3},
		{3, 2, 3, 2},
	} {
		e.SetLimit(tc.n, tc.seats)
		if _, limit, _ := e.Load(); limit != tc.limit || e.Seats() != tc.wantSeats {
			t.Errorf("SetLimit(%d, %d): limit %d, seats %d; want %d and %d", tc.n, tc.seats, limit, e.Seats(), tc.limit, tc.wantSeats)
		}
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
