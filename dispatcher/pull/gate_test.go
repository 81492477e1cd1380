package pull

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/queues"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestDecodeGateCountsWhatItLetThrough: within one look at the decode
// backlog, the prefills the gate let through count as waiting handoffs,
// so a burst cannot pass a gate that a fresh look would close; the next
// look starts from what is there.
func TestDecodeGateCountsWhatItLetThrough(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, pool, time.Second); err != nil {
		t.Fatal(err)
	}
	g := newGate(t, js, pool, 10*time.Second)
	// No decode worker is registered: the gate counts one slot, so one
	// handoff may wait for it.
	g.fresh = time.Hour // every call below within one look
	if !g.isOpen(ctx) {
		t.Fatal("an empty decode backlog: the gate is closed")
	}
	if !g.isOpen(ctx) {
		t.Fatal("no prefill was taken: the gate closed all the same")
	}
	g.Took()
	if g.isOpen(ctx) {
		t.Fatal("a second prefill within one look, for one decode slot: the gate is open")
	}
	g.fresh, g.idleFresh = 0, 0 // the next call looks again: nothing was handed off
	if !g.isOpen(ctx) {
		t.Fatal("a fresh look at an empty backlog: the gate is closed")
	}
	g.Took()
	if g.pending != 0 || g.since != 1 {
		t.Errorf("after a fresh look and a prefill: %d waiting, %d let through; want 0 and 1", g.pending, g.since)
	}
}

// TestDecodeGateHeadAge: whatever the decode workers report, the gate
// closes while the next handoff of its pool to be delivered has waited
// half the TTL; another pool's older handoff in the same stream does not
// count.
func TestDecodeGateHeadAge(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool, other := dispatcher.PoolName(t.Name()), dispatcher.PoolName(t.Name()+"-other")
	for _, p := range []string{pool, other} {
		if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, p, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	const ttl = time.Second
	g := newGate(t, js, pool, ttl)
	// A decode worker that reports room for a hundred handoffs.
	info, _ := json.Marshal(dispatcher.WorkerInfo{ID: "w1", Role: dispatcher.StageDecode, Pool: pool, Slots: 100, AvgJobMs: 1})
	if err := nc.Publish(dispatcher.WorkerSubject("w1"), info); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "the worker registered", func() bool { s, _ := g.registry.DecodeCapacity(pool); return s == 100 })

	handoff := func(p, id string) {
		job := &dispatcher.Job{ID: id, Model: "m", Pool: p, Endpoint: openai.Chat, Body: []byte(`{}`), KV: []byte(`{}`)}
		if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
			t.Fatal(err)
		}
	}
	handoff(other, "old-other")
	time.Sleep(ttl / 2)
	handoff(pool, "new")
	g.fresh, g.idleFresh = 0, 0
	if !g.isOpen(ctx) {
		t.Fatalf("a fresh handoff waits (another pool's has waited %v): the gate is closed", ttl/2)
	}
	time.Sleep(ttl/2 + 250*time.Millisecond) // a head is read anew at most every 250 ms
	if g.isOpen(ctx) {
		t.Errorf("the next handoff has waited %v of a %v TTL: the gate is open (it waited %v by the gate)", ttl/2, ttl, g.headAge)
	}
}

// newGate makes the decode gate of pool, with a watch of its decode
// queues and a registry of its own, until the test ends.
func newGate(t *testing.T, js jetstream.JetStream, pool string, ttl time.Duration) *DecodeGate {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	watch, err := queues.Open(ctx, js, dispatcher.StageDecode, pool, queues.Options{})
	if err != nil {
		t.Fatal(err)
	}
	reg, err := registry.WatchWorkers(ctx, js, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	return NewDecodeGate(watch, reg, pool, ttl, logging.Discard())
}

// engineGate makes a decode gate of ttl for a pool of its own, with the
// pool's decode consumer and engine http://decode's own.
func engineGate(t *testing.T, ttl time.Duration) (*nats.Conn, jetstream.JetStream, *DecodeGate) {
	t.Helper()
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, pool, time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := dispatcher.EnsureEngineConsumer(ctx, js, dispatcher.StageDecode, pool, dispatcher.EngineKey("http://decode"), time.Second); err != nil {
		t.Fatal(err)
	}
	g := newGate(t, js, pool, ttl)
	return nc, js, g
}

// TestDecodeGateCountsEnginesQueues: with decode affinity, handoffs that
// prefer a decode engine wait in its own consumer while it is full, not
// in the pool's; the gate counts them, and closes when they fill what the
// pool's decode workers can start within the TTL.
func TestDecodeGateCountsEnginesQueues(t *testing.T) {
	// Also while the worker's breaker is open (its engine failing): the
	// handoffs still wait in its consumer (a reviewer's finding: the gate
	// looked for affinity among the healthy workers only).
	for _, breaker := range []dispatcher.BreakerState{dispatcher.BreakerClosed, dispatcher.BreakerOpen} {
		t.Run(string(breaker), func(t *testing.T) { testDecodeGateCountsEnginesQueues(t, breaker) })
	}
}

func testDecodeGateCountsEnginesQueues(t *testing.T, breaker dispatcher.BreakerState) {
	ctx := context.Background()
	nc, js, g := engineGate(t, 10*time.Second)
	pool, engine := g.pool, "http://decode"
	// Its one decode worker runs 2 decodes at once, each 2 s long, and
	// takes the jobs that prefer its engine: with a 10 s TTL, 3 handoffs
	// may wait, the last for 3 rounds (6 s) would not.
	info, _ := json.Marshal(dispatcher.WorkerInfo{ID: "w1", Role: dispatcher.StageDecode, Pool: pool, Engine: engine, Slots: 2, AvgJobMs: 2000,
		Affinity: true, Breaker: breaker})
	if err := nc.Publish(dispatcher.WorkerSubject("w1"), info); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "the worker registered", func() bool { return g.registry.AnyAffinity(dispatcher.StageDecode, pool) })
	g.fresh, g.idleFresh = 0, 0
	if !g.isOpen(ctx) {
		t.Fatal("no handoff waits: the gate is closed")
	}
	for i := range 4 {
		job := &dispatcher.Job{ID: fmt.Sprintf("h-%d", i), Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), KV: []byte(`{}`),
			PreferDecode: dispatcher.EngineKey(engine)}
		if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
			t.Fatal(err)
		}
	}
	// The server counts a stored message in its consumers' pending after
	// the publish's ack, from a loop of its own (nats-server's
	// signalConsumersLoop): wait for the count, as the gate's next look
	// in a worker would.
	dispatchertest.WaitFor(t, "the consumers count the 4 handoffs", func() bool {
		all, err := dispatcher.PoolConsumers(ctx, js, dispatcher.StageDecode, pool)
		n := 0
		for _, c := range all {
			n += int(c.NumPending)
		}
		return err == nil && n == 4
	})
	g.fresh, g.idleFresh = 0, 0
	if g.isOpen(ctx) {
		t.Errorf("4 handoffs wait for the engine's 2 decodes of 2 s (the gate saw %d): the gate is open", g.pending)
	}
}

// TestDecodeGateHeadAgePreferred: the head-age guard counts a handoff
// that waits in a decode engine's own consumer (decode affinity), not
// only the pool's (a reviewer's finding: it saw none there).
func TestDecodeGateHeadAgePreferred(t *testing.T) {
	ctx := context.Background()
	const ttl = time.Second
	nc, js, g := engineGate(t, ttl)
	pool, engine := g.pool, "http://decode"
	// A decode worker that reports room for a hundred handoffs, and takes
	// the jobs that prefer its engine.
	info, _ := json.Marshal(dispatcher.WorkerInfo{ID: "w1", Role: dispatcher.StageDecode, Pool: pool, Engine: engine, Slots: 100, AvgJobMs: 1, Affinity: true})
	if err := nc.Publish(dispatcher.WorkerSubject("w1"), info); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "the worker registered", func() bool { s, _ := g.registry.DecodeCapacity(pool); return s == 100 })
	job := &dispatcher.Job{ID: "new", Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), KV: []byte(`{}`), PreferDecode: dispatcher.EngineKey(engine)}
	if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
		t.Fatal(err)
	}
	g.fresh, g.idleFresh = 0, 0
	if !g.isOpen(ctx) {
		t.Fatal("a fresh handoff waits: the gate is closed")
	}
	time.Sleep(ttl/2 + 250*time.Millisecond) // a head is read anew at most every 250 ms
	if g.isOpen(ctx) {
		t.Errorf("the next handoff, preferring an engine, has waited %v of a %v TTL: the gate is open (it waited %v by the gate)", ttl/2, ttl, g.headAge)
	}
}

func TestDecodeRoom(t *testing.T) {
	const ttl = 25 * time.Second
	for _, tc := range []struct {
		name                 string
		pending, idle, slots int
		avg                  time.Duration
		want                 bool
	}{
		{"an idle slot takes the handoff at once", 0, 1, 4, time.Minute, true},
		{"more idle slots than waiting handoffs", 2, 3, 4, time.Minute, true},
		{"no average yet: fewer waiting than slots", 3, 0, 4, 0, true},
		{"no average yet: as many waiting as slots", 4, 0, 4, 0, false},
		{"short decodes: a queue of rounds within half the TTL", 10, 0, 4, 4 * time.Second, true}, // 3 rounds of 4 s
		{"short decodes: rounds past half the TTL", 14, 0, 4, 4 * time.Second, false},             // 4 rounds of 4 s
		{"short decodes: too many rounds", 20, 0, 4, 4 * time.Second, false},                      // 6 rounds of 4 s
		{"decodes longer than the TTL: only a free slot will do", 0, 0, 4, 30 * time.Second, false},
		{"no slots known: one at a time", 0, 0, 0, 0, true},
	} {
		if got := decodeRoom(tc.pending, tc.idle, tc.slots, tc.avg, ttl); got != tc.want {
			t.Errorf("%s: decodeRoom(%d, %d, %d, %v) = %v, want %v", tc.name, tc.pending, tc.idle, tc.slots, tc.avg, got, tc.want)
		}
	}
}

// TestDecodeGateIdleLooks: a look that found the pool idle (nothing
// waiting, the gate open) serves for gateIdleFresh, not gateFresh; a
// prefill let through since brings the next look back to gateFresh.
func TestDecodeGateIdleLooks(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, pool, time.Second); err != nil {
		t.Fatal(err)
	}
	g := newGate(t, js, pool, 10*time.Second)
	if !g.isOpen(ctx) {
		t.Fatal("an empty decode backlog: the gate is closed")
	}
	first := g.looked
	time.Sleep(4 * gateFresh)
	g.isOpen(ctx)
	if g.looked != first {
		t.Errorf("an idle gate looked again after %v; want its look to serve %v", 4*gateFresh, gateIdleFresh)
	}
	g.Took()
	time.Sleep(2 * gateFresh)
	g.isOpen(ctx)
	if g.looked == first {
		t.Errorf("a prefill let through, %v later the gate had not looked again", 2*gateFresh)
	}
}

// TestDecodeGateAsksForNews: a gate closed by the prefills it let through
// since the decode pool's last report asks the reporter for news, and
// opens on its answer, rather than waiting for the next report, which an
// idle reporter sends only every queues.IdleEvery (the regression that
// sent a document's prefill to another engine in TestAffinityThroughUp).
// The test is the reporter: its first report says its next is a minute
// away, and it answers each ask with the same news.
func TestDecodeGateAsksForNews(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, pool, time.Second); err != nil {
		t.Fatal(err)
	}
	report, _ := json.Marshal(queues.Report{By: "reporter", NextMs: time.Minute.Milliseconds()})
	asked := make(chan struct{}, 100)
	sub, err := nc.Subscribe(dispatcher.QueuesAskSubject(dispatcher.StageDecode, pool, "reporter"), func(m *nats.Msg) {
		asked <- struct{}{}
		_ = nc.Publish(dispatcher.QueuesSubject(dispatcher.StageDecode, pool), report)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	g := newGate(t, js, pool, 10*time.Second)
	if err := nc.Publish(dispatcher.QueuesSubject(dispatcher.StageDecode, pool), report); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "the gate reads the report", func() bool {
		r, err := g.watch.Latest(ctx, time.Hour)
		return err == nil && r.By == "reporter"
	})
	// No decode worker registered: one slot, no average; one prefill let
	// through fills it.
	if !g.isOpen(ctx) {
		t.Fatal("nothing waits: the gate is closed")
	}
	g.Took()
	dispatchertest.WaitFor(t, "the gate opens on news", func() bool { return g.isOpen(ctx) })
	if len(asked) == 0 {
		t.Error("the gate opened without asking")
	}
}

// TestDecodeGateNoAffinity: while no decode worker of the pool takes the
// jobs that prefer its engine, handoffs left in an engine's consumer
// (affinity turned off, or a rollback) are no one's to decode: the gate
// counts only the pool's queue, and stays open (a reviewer's finding: the
// pool's report counts every consumer).
func TestDecodeGateNoAffinity(t *testing.T) {
	ctx := context.Background()
	nc, js, g := engineGate(t, time.Second)
	pool, engine := g.pool, "http://decode"
	info, _ := json.Marshal(dispatcher.WorkerInfo{ID: "w1", Role: dispatcher.StageDecode, Pool: pool, Engine: engine, Slots: 100, AvgJobMs: 1})
	if err := nc.Publish(dispatcher.WorkerSubject("w1"), info); err != nil {
		t.Fatal(err)
	}
	dispatchertest.WaitFor(t, "the worker registered", func() bool { return len(g.registry.Engines(dispatcher.StageDecode, pool)) == 1 })
	for i := range 4 {
		job := &dispatcher.Job{ID: fmt.Sprintf("h-%d", i), Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), KV: []byte(`{}`),
			PreferDecode: dispatcher.EngineKey(engine)}
		if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
			t.Fatal(err)
		}
	}
	g.fresh, g.idleFresh = 0, 0
	dispatchertest.WaitFor(t, "the report counts the 4 handoffs", func() bool {
		r, err := g.watch.Latest(ctx, 0)
		return err == nil && r.Pending == 4
	})
	time.Sleep(g.ttl/2 + 250*time.Millisecond) // old enough to close the gate, were they counted
	if !g.isOpen(ctx) {
		t.Errorf("4 handoffs left in an engine's consumer, no decode worker with affinity (the gate saw %d, the oldest %v): the gate is closed",
			g.pending, g.headAge)
	}
}
