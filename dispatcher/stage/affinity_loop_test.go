package stage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// affinityPool runs loops of one stage and pool with affinity on, one per
// engine URL, each with slots slots; a job's handler notes which engine ran
// it, and holds while block is set for that engine.
type affinityPool struct {
	lt    map[string]*loopTest
	mu    sync.Mutex
	ran   map[string]string // job id → engine
	hold  map[string]chan struct{}
	order []string
}

func startAffinityPool(t *testing.T, stage dispatcher.Stage, slots map[string]int) *affinityPool {
	t.Helper()
	nc, js := dispatchertest.JetStream(t)
	p := &affinityPool{lt: map[string]*loopTest{}, ran: map[string]string{}, hold: map[string]chan struct{}{}}
	pool := dispatcher.PoolName(t.Name())
	for engine, n := range slots {
		p.hold[engine] = make(chan struct{})
		close(p.hold[engine]) // not held
		p.lt[engine] = startLoopOn(t, nc, js, pool, Config{Stage: stage, Slots: n, Affinity: true, EngineSlots: pull.NewEngineSlots(n),
			Worker: dispatcher.WorkerInfo{Engine: engine, Slots: n},
			Handler: func(ctx context.Context, d *Delivery) error {
				p.mu.Lock()
				p.ran[d.Job.ID] = engine
				p.order = append(p.order, d.Job.ID)
				hold := p.hold[engine]
				p.mu.Unlock()
				select {
				case <-hold:
				case <-ctx.Done():
				}
				return nil
			}})
	}
	return p
}

// block makes engine's jobs wait until the returned function is called.
func (p *affinityPool) block(engine string) (release func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ch := make(chan struct{})
	p.hold[engine] = ch
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func (p *affinityPool) submit(t *testing.T, any *loopTest, id, prefer string) {
	t.Helper()
	s, err := any.replies.Open(id)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	job := &dispatcher.Job{ID: id, Model: "m", Pool: any.pool, Endpoint: openai.Chat, Body: []byte(`{}`),
		ReplyTo: any.replies.Subject(id), Deadline: time.Now().Add(time.Minute)}
	if any.stage == dispatcher.StagePrefill {
		job.Prefer = prefer
	} else {
		job.PreferDecode = prefer
	}
	any.submitJob(job)
}

func (p *affinityPool) ranOn(id string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ran[id]
}

func (p *affinityPool) waitRan(t *testing.T, id string) string {
	t.Helper()
	dispatchertest.WaitFor(t, id+" run", func() bool { return p.ranOn(id) != "" })
	return p.ranOn(id)
}

// stages runs test for each stage, as affinity works alike for both.
func stages(t *testing.T, test func(t *testing.T, stage dispatcher.Stage)) {
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		t.Run(string(stage), func(t *testing.T) { test(t, stage) })
	}
}

// TestAffinityPreferredEngine: a job that prefers an engine with room runs
// there, every time, though another engine is idle too.
func TestAffinityPreferredEngine(t *testing.T) { stages(t, testAffinityPreferredEngine) }

func testAffinityPreferredEngine(t *testing.T, stage dispatcher.Stage) {
	p := startAffinityPool(t, stage, map[string]int{"http://a": 2, "http://b": 2})
	key := dispatcher.EngineKey("http://a")
	for i := range 12 {
		id := fmt.Sprintf("pref-%d", i)
		p.submit(t, p.lt["http://b"], id, key)
		if got := p.waitRan(t, id); got != "http://a" {
			t.Fatalf("%s preferred http://a, which had room, and ran on %s", id, got)
		}
	}
	// A job that prefers nobody runs anywhere: the shared queue.
	p.submit(t, p.lt["http://a"], "anyone", "")
	p.waitRan(t, "anyone")
}

// TestAffinityTakeOver: a job that prefers an engine whose slots are all
// busy, or an engine that is gone, is taken by another, within the
// take-over bound; so no engine idles while a job waits for another.
func TestAffinityTakeOver(t *testing.T) { stages(t, testAffinityTakeOver) }

func testAffinityTakeOver(t *testing.T, stage dispatcher.Stage) {
	p := startAffinityPool(t, stage, map[string]int{"http://a": 1, "http://b": 4})
	a := dispatcher.EngineKey("http://a")
	release := p.block("http://a")
	defer release()
	p.submit(t, p.lt["http://b"], "first", a)
	if got := p.waitRan(t, "first"); got != "http://a" {
		t.Fatalf("first ran on %s, want http://a (it had room)", got)
	}
	// a is full now: the next jobs that prefer it go to b, while a is
	// still busy with the first.
	start := time.Now()
	for i := range 4 {
		p.submit(t, p.lt["http://b"], fmt.Sprintf("busy-%d", i), a)
	}
	for i := range 4 {
		if got := p.waitRan(t, fmt.Sprintf("busy-%d", i)); got != "http://b" {
			t.Errorf("busy-%d ran on %s while http://a was full, want http://b", i, got)
		}
	}
	t.Logf("4 jobs taken over from a full engine in %v", time.Since(start).Round(time.Millisecond))

	// An engine with no worker at all (gone): its jobs run elsewhere.
	p.submit(t, p.lt["http://b"], "orphan", dispatcher.EngineKey("http://gone"))
	if got := p.waitRan(t, "orphan"); got != "http://b" {
		t.Errorf("the job of a gone engine ran on %s, want http://b (a is full)", got)
	}
	if n := p.lt["http://a"].loop.InFlight(); n != 1 {
		t.Errorf("a runs %d jobs, want its 1 slot's", n)
	}
	release()
}

// TestAffinityTakeOverRedelivery: a job that its preferred engine's worker
// took and never acked (killed mid-prefill) is delivered again from that
// engine's consumer; with the worker gone, another takes it over once its
// ack wait has run out (NumPending does not count it: it is ack-pending).
func TestAffinityTakeOverRedelivery(t *testing.T) { stages(t, testAffinityTakeOverRedelivery) }

func testAffinityTakeOverRedelivery(t *testing.T, stage dispatcher.Stage) {
	p := startAffinityPool(t, stage, map[string]int{"http://b": 2})
	b := p.lt["http://b"]
	a := dispatcher.EngineKey("http://a")
	ctx := context.Background()
	cons, err := dispatcher.EnsureEngineConsumer(ctx, b.js, stage, b.pool, a, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	p.submit(t, b, "killed", a)
	// a's worker takes it, and dies before it acks.
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for range batch.Messages() {
	}
	if got := p.waitRan(t, "killed"); got != "http://b" {
		t.Errorf("the job of a dead worker ran on %s, want http://b", got)
	}
}

// TestHandoffPreference: a prefill's handoff goes to the decode engine the
// job prefers while every live decode worker of the pool takes the jobs
// that prefer its engine, that one among them; else to the pool's queue,
// which any decode worker pulls (one of an earlier build, or with
// affinity off, would never pull or take over the other).
func TestHandoffPreference(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	lt := startLoop(t, nc, js, Config{Handler: func(ctx context.Context, d *Delivery) error {
		d.HandOff([]byte(`{"remote_block_ids":[[1]]}`), dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
		return nil
	}})
	decoder := func(id, engine string, affinity bool) {
		info, _ := json.Marshal(dispatcher.WorkerInfo{ID: id, Role: dispatcher.StageDecode, Pool: lt.pool, Engine: engine, Slots: 4, Affinity: affinity})
		if err := nc.Publish(dispatcher.WorkerSubject(id), info); err != nil {
			t.Fatal(err)
		}
	}
	// where is the subject the handoff of id was stored on.
	where := func(id string) string {
		t.Helper()
		st, err := js.Stream(ctx, dispatcher.StreamDecode)
		if err != nil {
			t.Fatal(err)
		}
		var subject string
		dispatchertest.WaitFor(t, "the handoff of "+id, func() bool {
			for _, s := range dispatcher.JobSubjects(dispatcher.StageDecode, lt.pool, id) {
				if m, err := st.GetLastMsgForSubject(ctx, s); err == nil {
					subject = m.Subject
					return true
				}
			}
			return false
		})
		return subject
	}
	submit := func(id string) {
		s, err := lt.replies.Open(id)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		lt.submitJob(&dispatcher.Job{ID: id, Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`),
			ReplyTo: lt.replies.Subject(id), Deadline: time.Now().Add(time.Minute), PreferDecode: dispatcher.EngineKey("http://d1")})
	}
	submit("no-decoder") // no decode worker at all
	if got := where("no-decoder"); got != dispatcher.JobSubject(dispatcher.StageDecode, lt.pool, "no-decoder") {
		t.Errorf("with no decode worker, the handoff went to %s, want the pool's queue", got)
	}
	decoder("w1", "http://d1", true)
	time.Sleep(200 * time.Millisecond) // the gate's registry hears it
	submit("preferred")
	if got, want := where("preferred"), dispatcher.PreferredSubject(dispatcher.StageDecode, lt.pool, "preferred", dispatcher.EngineKey("http://d1")); got != want {
		t.Errorf("with the preferred engine's worker taking its jobs, the handoff went to %s, want %s", got, want)
	}
	decoder("w2", "http://d2", false) // an older build's, or affinity off
	time.Sleep(200 * time.Millisecond)
	submit("mixed")
	if got := where("mixed"); got != dispatcher.JobSubject(dispatcher.StageDecode, lt.pool, "mixed") {
		t.Errorf("with a decode worker that takes over nothing, the handoff went to %s, want the pool's queue", got)
	}
}

// TestAffinityTakeOverBehind: a job that prefers an engine which is busy
// and still delivers, a job every 50 ms, but gets more than it runs, is
// taken by another engine within the bound, not left to wait behind the
// others while that engine idles (a reviewer's finding: such an engine
// was never taken from, its queue growing).
func TestAffinityTakeOverBehind(t *testing.T) { stages(t, testAffinityTakeOverBehind) }

func testAffinityTakeOverBehind(t *testing.T, stage dispatcher.Stage) {
	p := startAffinityPool(t, stage, map[string]int{"http://a": 1, "http://b": 4})
	// a ends a job every 50 ms: its hold is released and made anew.
	p.mu.Lock()
	p.hold["http://a"] = make(chan struct{})
	p.mu.Unlock()
	stop := make(chan struct{})
	var ticks sync.WaitGroup
	ticks.Go(func() {
		for {
			select {
			case <-stop:
				p.mu.Lock()
				close(p.hold["http://a"])
				p.mu.Unlock()
				return
			case <-time.After(50 * time.Millisecond):
			}
			p.mu.Lock()
			done := p.hold["http://a"]
			p.hold["http://a"] = make(chan struct{})
			p.mu.Unlock()
			close(done)
		}
	})
	defer func() { close(stop); ticks.Wait() }()
	a := dispatcher.EngineKey("http://a")
	for i := range 40 { // one every 20 ms: 2.5 times what a runs
		p.submit(t, p.lt["http://b"], fmt.Sprintf("behind-%d", i), a)
		time.Sleep(20 * time.Millisecond)
	}
	for i := range 40 {
		p.waitRan(t, fmt.Sprintf("behind-%d", i))
	}
	onB := 0
	for i := range 40 {
		if p.ranOn(fmt.Sprintf("behind-%d", i)) == "http://b" {
			onB++
		}
	}
	if onB == 0 {
		t.Errorf("every job waited for http://a, 2.5 times over its capacity, while http://b idled")
	}
	t.Logf("%d of 40 jobs taken over by http://b", onB)
}

// TestHandBackPreference: a prefill handed back keeps its decode
// preference (the decode engine is not the trouble); a decode handed back
// loses it, and goes to any decode worker.
func TestHandBackPreference(t *testing.T) { stages(t, testHandBackPreference) }

func testHandBackPreference(t *testing.T, stage dispatcher.Stage) {
	nc, js := dispatchertest.JetStream(t)
	key := dispatcher.EngineKey("http://d")
	prefs := make(chan string, 4)
	var handedBack atomic.Bool
	lt := startLoopOn(t, nc, js, dispatcher.PoolName(t.Name()), Config{Stage: stage, Slots: 2, Affinity: true,
		EngineSlots: pull.NewEngineSlots(2), Worker: dispatcher.WorkerInfo{Engine: "http://d", Slots: 2},
		Handler: func(_ context.Context, d *Delivery) error {
			prefs <- d.Job.PreferDecode
			if handedBack.CompareAndSwap(false, true) {
				return verdict.HandBack(errors.New("breaker open"), openai.NewError(503, "engine unavailable"))
			}
			return nil
		}})
	s, err := lt.replies.Open("hb")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	lt.submitJob(&dispatcher.Job{ID: "hb", Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`),
		ReplyTo: lt.replies.Subject("hb"), Deadline: time.Now().Add(time.Minute), PreferDecode: key})
	want := []string{key, key}
	if stage == dispatcher.StageDecode {
		want[1] = ""
	}
	for i, w := range want {
		select {
		case got := <-prefs:
			if got != w {
				t.Errorf("run %d: decode preference %q, want %q", i+1, got, w)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("run %d did not come", i+1)
		}
	}
}

// TestHandedOff: a prefill redelivered after its handoff was stored finds
// the handoff, on the pool's subject or on a decode engine's, of its own
// generation only.
func TestHandedOff(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	for _, prefer := range []string{"", dispatcher.EngineKey("http://d")} {
		id := "h-" + prefer
		job := &dispatcher.Job{ID: id, Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), KV: []byte(`{}`), Generation: 2, PreferDecode: prefer}
		if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
			t.Fatal(err)
		}
		s := &settle{l: &Loop{js: js, cfg: Config{Stage: dispatcher.StagePrefill}, log: logging.Discard()}, job: &dispatcher.Job{ID: id, Pool: pool, Generation: 2}}
		if !s.handedOff(ctx) {
			t.Errorf("preferring %q: its handoff not found", prefer)
		}
		s.job.Generation = 3
		if s.handedOff(ctx) {
			t.Errorf("preferring %q: generation 2's handoff taken for generation 3's", prefer)
		}
	}
}
