package queues

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// TestStuckConsumer: an engine's consumer counts as stuck only when it
// has jobs its engine does not take: pending or ack-pending (a
// redelivery waits among those), no pull waiting, and nothing delivered
// for StuckAfter by the server's clock.
func TestStuckConsumer(t *testing.T) {
	now := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	long, short := now.Add(-2*StuckAfter), now.Add(-StuckAfter/2)
	for _, tc := range []struct {
		name                   string
		pending, ackPending    int
		waiting                int
		created, lastDelivered time.Time
		want                   bool
	}{
		{"empty", 0, 0, 0, long, time.Time{}, false},
		{"pending, never delivered, old", 2, 0, 0, long, time.Time{}, true},
		{"pending, new consumer", 2, 0, 0, short, time.Time{}, false},
		{"pending, delivered a moment ago", 2, 0, 0, long, short, false},
		{"pending, delivered long ago", 2, 0, 0, long, long, true},
		{"a pull waits", 2, 0, 1, long, long, false},
		{"only a redelivery waits", 0, 1, 0, long, long, true},
	} {
		info := &jetstream.ConsumerInfo{NumPending: uint64(tc.pending), NumAckPending: tc.ackPending, NumWaiting: tc.waiting,
			Created: tc.created, TimeStamp: now}
		if !tc.lastDelivered.IsZero() {
			last := tc.lastDelivered
			info.Delivered.Last = &last
		}
		if got := stuckConsumer(info); got != tc.want {
			t.Errorf("%s: stuck %v, want %v", tc.name, got, tc.want)
		}
	}
}

// pool makes a pool of its own with its shared prefill consumer, and an
// engine's consumer for engine key e.
func pool(t *testing.T, js jetstream.JetStream, e string) string {
	t.Helper()
	ctx := context.Background()
	p := dispatcher.PoolName(t.Name())
	if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, p, time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := dispatcher.EnsureEngineConsumer(ctx, js, dispatcher.StagePrefill, p, e, time.Minute); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReportCounts: a listing counts the jobs waiting in the shared
// consumer and the engines', and times the oldest; an engine's consumer
// whose jobs nobody pulls is named stuck from its second listing on; its
// pace slows while all is idle, doubling up to IdleEvery, and comes back
// to BusyEvery when jobs wait.
func TestReportCounts(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e := dispatcher.EngineKey("http://e")
	p := pool(t, js, e)
	w, err := Open(ctx, js, dispatcher.StagePrefill, p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	pace := func() int64 {
		w.listMu.Lock()
		defer w.listMu.Unlock()
		return w.pace.Milliseconds()
	}
	var paces []int64
	for range 5 {
		r, err := w.Latest(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		if r.Busy() {
			t.Fatalf("no job: the report says busy: %+v", r)
		}
		if r.NextMs < pace() {
			t.Errorf("a report's next in %d ms, under the pace %d ms", r.NextMs, pace())
		}
		paces = append(paces, pace())
	}
	if want := []int64{200, 400, 800, 1600, 1600}; !slices.Equal(paces, want) {
		t.Errorf("idle listings' paces %v ms, want %v", paces, want)
	}

	for _, subject := range []string{
		dispatcher.StageSubject(dispatcher.StagePrefill) + "." + p + ".shared-1",
		dispatcher.PreferredSubject(dispatcher.StagePrefill, p, "pref-1", e),
		dispatcher.PreferredSubject(dispatcher.StagePrefill, p, "pref-2", e),
	} {
		if _, err := js.Publish(ctx, subject, []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	// nats-server counts a stored message in its consumers after the
	// publish's ack, from a loop of its own.
	var r *Report
	dispatchertest.WaitFor(t, "the listing counts 3 jobs", func() bool {
		r, err = w.Latest(ctx, 0)
		return err == nil && r.Pending == 3
	})
	if pace() != BusyEvery.Milliseconds() {
		t.Errorf("jobs wait: next listing in %d ms, want %v", pace(), BusyEvery)
	}
	time.Sleep(2 * StuckAfter)
	// A watch of its own, which has not listed before: stuck on its first
	// listing is not enough; still stuck StuckAfter later, it is.
	w2, err := Open(ctx, js, dispatcher.StagePrefill, p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = w2.Latest(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if len(r.Stuck) != 0 {
		t.Errorf("a first listing names %+v stuck; want none until one StuckAfter later", r.Stuck)
	}
	time.Sleep(StuckAfter)
	if r, err = w2.Latest(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if r.Head() < 2*StuckAfter {
		t.Errorf("the oldest job waited %v, the report says %v", 2*StuckAfter, r.Head())
	}
	want := dispatcher.EngineConsumerName(dispatcher.StagePrefill, p, e)
	if len(r.Stuck) != 1 || r.Stuck[0].Consumer != want || r.Stuck[0].Jobs != 2 {
		t.Errorf("an engine's consumer with 2 jobs nobody pulls, on its second listing: stuck %+v, want %s with 2", r.Stuck, want)
	}
	if r.Waiting != 0 {
		t.Errorf("no pull waits: the report says %d", r.Waiting)
	}
}

// TestReporter: of the watches that publish for a pool, only the one
// whose id sorts first lists and publishes once they have heard each
// other, and the others, and a watch that only listens, read its report.
// When it stops, the next takes over.
func TestReporter(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	p := pool(t, js, dispatcher.EngineKey("http://e"))
	var mu sync.Mutex
	var by []string
	sub, err := nc.Subscribe(dispatcher.QueuesSubject(dispatcher.StagePrefill, p), func(m *nats.Msg) {
		var r Report
		if err := json.Unmarshal(m.Data, &r); err == nil {
			mu.Lock()
			by = append(by, r.By)
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	heard := func(d time.Duration) map[string]int {
		mu.Lock()
		by = nil
		mu.Unlock()
		time.Sleep(d)
		mu.Lock()
		defer mu.Unlock()
		n := map[string]int{}
		for _, b := range by {
			n[b]++
		}
		return n
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := map[string]context.CancelFunc{}
	adopted := map[string]*atomic.Int64{}
	for _, id := range []string{"b", "a", "c"} {
		var wctx context.Context
		wctx, stop[id] = context.WithCancel(ctx)
		defer stop[id]()
		n := &atomic.Int64{}
		adopted[id] = n
		adopt := func(context.Context) { n.Add(1) }
		if _, err := Open(wctx, js, dispatcher.StagePrefill, p, Options{ID: id, Publish: true, Adopt: adopt}); err != nil {
			t.Fatal(err)
		}
	}
	listener, err := Open(ctx, js, dispatcher.StagePrefill, p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "the listener reads a's reports", func() bool {
		r, err := listener.Latest(ctx, time.Hour)
		return err == nil && r.By == "a"
	})
	// Idle, a report every IdleEvery: over 3 of them, a's alone; and only
	// the reporter adopts orphaned jobs (b and c may have, once, before
	// they heard a: counted from a moment after).
	time.Sleep(200 * time.Millisecond)
	b0, c0 := adopted["b"].Load(), adopted["c"].Load()
	if n := heard(3 * IdleEvery); n["a"] == 0 || len(n) != 1 {
		t.Errorf("reports by the publishing watches, idle, over %v: %v; want a's alone", 3*IdleEvery, n)
	}
	if adopted["a"].Load() == 0 || adopted["b"].Load() != b0 || adopted["c"].Load() != c0 {
		t.Errorf("adoptions while a reports: a %d, b %d more, c %d more; want a's alone",
			adopted["a"].Load(), adopted["b"].Load()-b0, adopted["c"].Load()-c0)
	}
	stop["a"]()
	dispatchertest.WaitFor(t, "the listener reads b's reports", func() bool {
		r, err := listener.Latest(ctx, time.Hour)
		return err == nil && r.By == "b"
	})
	if n := heard(3 * IdleEvery); n["b"] == 0 || len(n) != 1 {
		t.Errorf("a stopped: reports over %v: %v; want b's alone", 3*IdleEvery, n)
	}
}
