package fair

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// queueRun drives a Queue with a limit of one running request: it
// enters requests one by one, in order, and records the order in which
// they are let in once the first one ends.
type queueRun struct {
	q     *Queue
	mu    sync.Mutex
	order []string
	turns map[string]*Turn
	wg    sync.WaitGroup
}

func newQueueRun(maxQueue int, weights map[string]float64) *queueRun {
	return &queueRun{q: New(maxQueue, func(t string) float64 { return weights[t] }, func() Limit { return Limit{Requests: 1} }),
		turns: map[string]*Turn{}}
}

// add enters a request and waits until it waits in the queue (or is in).
func (r *queueRun) add(t *testing.T, name, tenant string, priority, cost int) error {
	t.Helper()
	_, before := r.q.stats()
	errc := make(chan error, 1)
	r.wg.Go(func() {
		turn, err := r.q.Enter(context.Background(), tenant, priority, cost, 1)
		if err != nil {
			errc <- err
			return
		}
		r.mu.Lock()
		r.order = append(r.order, name)
		r.turns[name] = turn
		r.mu.Unlock()
		errc <- nil
	})
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-errc:
			return err
		default:
		}
		if _, waiting := r.q.stats(); waiting > before {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("%s neither entered nor waits", name)
	return nil
}

// drain ends the running requests one at a time until all have run, and
// returns the order they ran in.
func (r *queueRun) drain(t *testing.T, n int) []string {
	t.Helper()
	for i := 0; i < n; i++ {
		var name string
		deadline := time.Now().Add(5 * time.Second)
		for {
			r.mu.Lock()
			if len(r.order) > i {
				name = r.order[i]
			}
			r.mu.Unlock()
			if name != "" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("only %d of %d let in", i, n)
			}
			time.Sleep(time.Millisecond)
		}
		r.mu.Lock()
		turn := r.turns[name]
		r.mu.Unlock()
		turn.Done()
	}
	r.wg.Wait()
	return r.order
}

func TestFairQueueOrder(t *testing.T) {
	for _, tc := range []struct {
		name    string
		weights map[string]float64
		adds    [][4]string // name, tenant, priority, cost
		want    string
	}{
		{"one tenant: first come first served", nil,
			[][4]string{{"a1", "a", "0", "1"}, {"a2", "a", "0", "1"}, {"a3", "a", "0", "1"}}, "a1 a2 a3"},
		{"a flood does not hold the small tenant back", nil,
			[][4]string{{"a1", "a", "0", "1"}, {"a2", "a", "0", "1"}, {"a3", "a", "0", "1"}, {"a4", "a", "0", "1"}, {"b1", "b", "0", "1"}},
			"a1 b1 a2 a3 a4"},
		// a's four after its first take three turns to b's one.
		{"weights share the turns", map[string]float64{"a": 3},
			[][4]string{{"a0", "a", "0", "1"}, {"a1", "a", "0", "1"}, {"a2", "a", "0", "1"}, {"a3", "a", "0", "1"}, {"a4", "a", "0", "1"},
				{"b1", "b", "0", "1"}, {"b2", "b", "0", "1"}},
			"a0 b1 a1 a2 a3 b2 a4"},
		// big asks for ten times the work: a3 waits for b's two.
		{"work, not requests, is shared", nil,
			[][4]string{{"a1", "a", "0", "1"}, {"big", "a", "0", "10"}, {"a3", "a", "0", "1"}, {"b1", "b", "0", "1"}, {"b2", "b", "0", "1"}},
			"a1 b1 big b2 a3"},
		{"priority first, lower first", nil,
			[][4]string{{"run", "a", "0", "1"}, {"p1", "a", "1", "1"}, {"p5", "b", "5", "1"}, {"p0", "b", "0", "1"}, {"n1", "c", "-1", "1"}},
			"run n1 p0 p1 p5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newQueueRun(100, tc.weights)
			for _, a := range tc.adds {
				var prio, cost int
				fmt.Sscan(a[2], &prio)
				fmt.Sscan(a[3], &cost)
				if err := r.add(t, a[0], a[1], prio, cost); err != nil {
					t.Fatal(err)
				}
			}
			if got := fmt.Sprint(r.drain(t, len(tc.adds))); got != "["+tc.want+"]" {
				t.Errorf("order %s, want [%s]", got, tc.want)
			}
		})
	}
}

// TestFairQueueShare: a tenant's waiting requests are bounded by its share
// of the queue among the tenants present, so a flood is refused before
// another tenant's request is.
func TestFairQueueShare(t *testing.T) {
	r := newQueueRun(10, nil)
	if err := r.add(t, "running", "a", 0, 1); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := r.add(t, fmt.Sprintf("a%d", i), "a", 0, 1); err != nil {
			t.Fatalf("a%d: %v; a alone may queue 10", i, err)
		}
	}
	if err := r.add(t, "a-over", "a", 0, 1); !errors.Is(err, ErrTenantFull) {
		t.Fatalf("an 11th of a's: %v, want ErrTenantFull", err)
	}
	for i := range 5 {
		if err := r.add(t, fmt.Sprintf("b%d", i), "b", 0, 1); err != nil {
			t.Fatalf("b%d refused while a floods: %v; b's share is 5", i, err)
		}
	}
	if err := r.add(t, "b-over", "b", 0, 1); !errors.Is(err, ErrTenantFull) {
		t.Errorf("a 6th of b's: %v, want ErrTenantFull", err)
	}
	r.drain(t, 16)
	if running, waiting := r.q.stats(); running != 0 || waiting != 0 {
		t.Errorf("running %d, waiting %d after all ended", running, waiting)
	}
}

func TestFairQueueGivesUp(t *testing.T) {
	q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1} })
	turn, err := q.Enter(context.Background(), "a", 0, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := q.Enter(ctx, "b", 0, 1, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a wait past its deadline: %v", err)
	}
	if _, waiting := q.stats(); waiting != 0 {
		t.Errorf("%d waiting after the only waiter gave up", waiting)
	}
	turn.Done()
	turn.Done() // twice: counted once
	if running, _ := q.stats(); running != 0 {
		t.Errorf("%d running after the only request ended", running)
	}
	// Tenants come and go (the body's user is the client's to name): the
	// queue keeps only those present.
	for i := range 100 {
		turn, err := q.Enter(context.Background(), fmt.Sprintf("tenant-%d", i), 0, 10, 10)
		if err != nil {
			t.Fatal(err)
		}
		turn.Done()
	}
	if n := q.tenantsKept(); n != 0 {
		t.Errorf("%d tenants kept after all left, want 0", n)
	}
}

// TestFairQueueStarted: a request whose first answer came holds no turn,
// so the next goes in while it decodes; it still counts for its tenant
// until it ends.
func TestFairQueueStarted(t *testing.T) {
	q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1} })
	first, err := q.Enter(context.Background(), "a", 0, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	next := make(chan *Turn, 1)
	go func() {
		turn, err := q.Enter(context.Background(), "b", 0, 1, 1)
		if err != nil {
			t.Error(err)
		}
		next <- turn
	}()
	for _, waiting := q.stats(); waiting == 0; _, waiting = q.stats() {
		time.Sleep(time.Millisecond)
	}
	first.Started()
	first.Started() // twice: counted once
	second := <-next
	if running, waiting := q.stats(); running != 1 || waiting != 0 {
		t.Errorf("running %d, waiting %d once the first started; want 1 and 0", running, waiting)
	}
	if n := q.tenantsKept(); n != 2 {
		t.Errorf("%d tenants kept while both requests run; want 2", n)
	}
	first.Done()
	second.Done()
	if running, _ := q.stats(); running != 0 || q.tenantsKept() != 0 {
		t.Errorf("running %d, %d tenants kept after both ended", running, q.tenantsKept())
	}
}

// TestFairQueueLimit: small requests go in together while their load fits
// (up to Most), a large one goes in alone within the request count, and
// one that does not fit waits, holding back those behind it.
func TestFairQueueLimit(t *testing.T) {
	q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Most: 3, Load: 10} })
	enter := func(tenant string, load int) *Turn {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		turn, err := q.Enter(ctx, tenant, 0, load, load)
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatal(err)
		}
		return turn
	}
	a, b, c := enter("a", 4), enter("b", 4), enter("c", 2)
	if a == nil || b == nil || c == nil {
		t.Fatalf("small requests within the load kept out: %v %v %v", a, b, c)
	}
	if d := enter("d", 1); d != nil {
		t.Errorf("a fourth request let in past Most (3)")
	}
	a.Started()
	b.Started()
	c.Started()
	big := enter("big", 50)
	if big == nil {
		t.Fatal("a request over the load kept out while none runs")
	}
	if e := enter("e", 1); e != nil {
		t.Error("a request let in past the count while the load is full")
	}
	big.Done()
	if f := enter("f", 1); f == nil {
		t.Error("a small request kept out once the big one ended")
	}
}

// TestFairQueueHeadOfLine: a waiter that fits goes in as soon as the one
// ahead of it that did not fit leaves, and one of a better priority goes
// in past a waiter that does not fit, without waiting for a request to
// start.
func TestFairQueueHeadOfLine(t *testing.T) {
	limit := func() Limit { return Limit{Requests: 1, Most: 3, Load: 10} }
	waitWaiting := func(q *Queue, n int) {
		for _, w := q.stats(); w < n; _, w = q.stats() {
			time.Sleep(time.Millisecond)
		}
	}
	enter := func(q *Queue, ctx context.Context, tenant string, priority, load int) chan *Turn {
		c := make(chan *Turn, 1)
		go func() {
			turn, _ := q.Enter(ctx, tenant, priority, load, load)
			c <- turn
		}()
		return c
	}
	let := func(t *testing.T, c chan *Turn, what string) {
		t.Helper()
		select {
		case turn := <-c:
			if turn == nil {
				t.Fatalf("%s: refused", what)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: still waits", what)
		}
	}
	t.Run("the head leaves", func(t *testing.T) {
		q := New(10, func(string) float64 { return 1 }, limit)
		a, _ := q.Enter(context.Background(), "a", 0, 4, 4)
		ctx, cancel := context.WithCancel(context.Background())
		big := enter(q, ctx, "b", 0, 50)
		waitWaiting(q, 1)
		small := enter(q, context.Background(), "c", 0, 1)
		waitWaiting(q, 2)
		cancel()
		<-big
		let(t, small, "a small request once the big one ahead of it left")
		a.Done()
	})
	t.Run("a better priority", func(t *testing.T) {
		q := New(10, func(string) float64 { return 1 }, limit)
		a, _ := q.Enter(context.Background(), "a", 1, 4, 4)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		enter(q, ctx, "b", 1, 50)
		waitWaiting(q, 1)
		let(t, enter(q, context.Background(), "c", 0, 1), "a priority 0 request that fits, behind one that does not")
		a.Done()
	})
}

// TestFairQueueBypass: with the pool full, a request that goes first and
// outranks a request let in goes in at once by the bypass, up to its
// bound; one among equals, or behind a waiting one as good, waits; a
// bypass turn that starts frees its place for the next that outranks.
func TestFairQueueBypass(t *testing.T) {
	q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Bypass: 1} })
	ctx := context.Background()
	enter := func(priority int) (*Turn, error) {
		c, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		return q.EnterOrBypass(c, "t", priority, 1, 1)
	}
	low, err := enter(1)
	if err != nil || low.Bypassed() {
		t.Fatalf("the first request: %v, bypassed %v; want in by the limit", err, low != nil && low.Bypassed())
	}
	if _, err := enter(1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a request as good as the one let in, the pool full: %v, want it to wait", err)
	}
	urgent, err := enter(0)
	if err != nil || !urgent.Bypassed() {
		t.Fatalf("a request that outranks the one let in: %v, want in by the bypass", err)
	}
	if _, err := enter(0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a second while the bypass is taken: %v, want it to wait", err)
	}
	c, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := q.Enter(c, "t", -1, 1, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a request that may not bypass (Enter): %v, want it to wait", err)
	}
	// The bypass frees as its request starts: the next urgent one waits
	// in the queue meanwhile, and goes in by it then.
	next := make(chan *Turn, 1)
	go func() {
		turn, err := q.EnterOrBypass(ctx, "t", 0, 1, 1)
		if err != nil {
			t.Error(err)
		}
		next <- turn
	}()
	waitUntil(t, func() bool { _, waiting := q.stats(); return waiting == 1 })
	urgent.Started()
	if turn := <-next; !turn.Bypassed() {
		t.Error("the urgent request that waited went in by the limit, the pool full")
	}
	// Among equals there is no bypass: with the limit's place taken by
	// priority 0, another priority 0 waits.
	low.Done()
	q2 := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Bypass: 4} })
	if _, err := q2.EnterOrBypass(ctx, "t", 0, 1, 1); err != nil {
		t.Fatal(err)
	}
	c, cancel = context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := q2.EnterOrBypass(c, "t", 0, 1, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a request among equals: %v, want it to wait", err)
	}
}

// TestFairQueueBypassTenant: at one priority, a request of a tenant that
// holds no turn, while another tenant holds more than its share of them,
// goes in by the bypass; one of the tenant that holds them waits, and so
// does one whose tenant has a turn of its own.
func TestFairQueueBypassTenant(t *testing.T) {
	q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 2, Bypass: 2} })
	ctx := context.Background()
	enter := func(tenant string) (*Turn, error) {
		c, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		return q.EnterOrBypass(c, tenant, 0, 1, 1)
	}
	for range 2 {
		if turn, err := enter("big"); err != nil || turn.Bypassed() {
			t.Fatalf("the flood's first requests: %v, want in by the limit", err)
		}
	}
	if _, err := enter("big"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the flood's third request: %v, want it to wait", err)
	}
	small, err := enter("small")
	if err != nil || !small.Bypassed() {
		t.Fatalf("another tenant's request, the flood holding every turn: %v, want in by the bypass", err)
	}
	// Two tenants a turn each: none holds more than its share.
	q2 := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 2, Bypass: 2} })
	for _, tenant := range []string{"a", "b"} {
		if _, err := q2.EnterOrBypass(ctx, tenant, 0, 1, 1); err != nil {
			t.Fatal(err)
		}
	}
	for _, tenant := range []string{"a", "c"} {
		c, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		_, err := q2.EnterOrBypass(c, tenant, 0, 1, 1)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("tenant %s, with the turns shared: %v, want it to wait", tenant, err)
		}
	}
}

// TestFairQueueBypassRules: no bypass past a waiting request that goes
// first (a batch, which may not bypass, of as good a priority), nor past
// a turn of a better priority; and the limit is read once a decision (a
// limit that changes between two reads made a request that may not
// bypass a bypassed one: a reviewer's finding).
func TestFairQueueBypassRules(t *testing.T) {
	ctx := context.Background()
	wait := func(q *Queue, tenant string, priority int) error {
		c, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		_, err := q.EnterOrBypass(c, tenant, priority, 1, 1)
		return err
	}
	q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Bypass: 1} })
	if _, err := q.EnterOrBypass(ctx, "big", 1, 1, 1); err != nil {
		t.Fatal(err)
	}
	batch, cancel := context.WithCancel(ctx)
	defer cancel()
	go q.Enter(batch, "big", 0, 1, 1) // waits: it may not bypass
	waitUntil(t, func() bool { _, w := q.stats(); return w == 1 })
	if err := wait(q, "big", 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("behind a waiting request as good that goes first: %v, want it to wait", err)
	}
	q2 := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 2, Bypass: 1} })
	for _, p := range []int{0, 2} {
		if _, err := q2.EnterOrBypass(ctx, "x", p, 1, 1); err != nil {
			t.Fatal(err)
		}
	}
	if err := wait(q2, "x", 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("priority 1 among turns of priority 0 and 2: %v, want it to wait", err)
	}
	calls := 0
	q3 := New(10, func(string) float64 { return 1 }, func() Limit {
		if calls++; calls == 1 {
			return Limit{Requests: 1}
		}
		return Limit{} // the engine's heartbeat aged out meanwhile
	})
	turn, err := q3.Enter(ctx, "t", 0, 1, 1)
	if err != nil || turn.Bypassed() {
		t.Errorf("a request entered by Enter, Bypass 0, as the limit changed: %v, bypassed %v", err, err == nil && turn.Bypassed())
	}
}

func waitUntil(t *testing.T, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !ok(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not within 5s")
		}
	}
}

// TestFairQueueAlikeLoad: while the work is of one tenant and one
// priority, the load bound is AlikeLoad; a request of another tenant or
// priority, let in or waiting, or entering, puts Load back.
func TestFairQueueAlikeLoad(t *testing.T) {
	type req struct {
		tenant   string
		priority int
	}
	for _, tc := range []struct {
		name string
		in   []req // let in first, each of load 4, not started
		next req   // then a request of load 4
		want bool  // let in
	}{
		{"one tenant and priority: past Load, within AlikeLoad", []req{{"a", 1}, {"a", 1}}, req{"a", 1}, true},
		{"up to AlikeLoad only", []req{{"a", 1}, {"a", 1}, {"a", 1}, {"a", 1}}, req{"a", 1}, false},
		{"another tenant entering", []req{{"a", 1}, {"a", 1}}, req{"b", 1}, false},
		{"another tenant let in", []req{{"b", 1}, {"a", 1}}, req{"a", 1}, false},
		{"another priority entering", []req{{"a", 1}, {"a", 1}}, req{"a", 0}, false},
		{"another priority let in", []req{{"a", 0}, {"a", 1}}, req{"a", 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Load 8: two requests of 4; AlikeLoad 16: four.
			q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Most: 10, Load: 8, AlikeLoad: 16} })
			for i, r := range tc.in {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, err := q.Enter(ctx, r.tenant, r.priority, 4, 4)
				cancel()
				if err != nil {
					t.Fatalf("request %d of those let in first: %v", i, err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			turn, err := q.Enter(ctx, tc.next.tenant, tc.next.priority, 4, 4)
			if err != nil && !errors.Is(err, context.DeadlineExceeded) {
				t.Fatal(err)
			}
			if got := turn != nil; got != tc.want {
				t.Errorf("let in: %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("no AlikeLoad: Load alone", func(t *testing.T) {
		q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Most: 10, Load: 8} })
		for i := range 2 {
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			turn, _ := q.Enter(ctx, "a", 1, 4, 4)
			cancel()
			if turn == nil {
				t.Fatalf("request %d of one tenant, within Load, kept out", i)
			}
		}
	})
	t.Run("a waiting request of another tenant, behind", func(t *testing.T) {
		// Tenant b's work so far ends far ahead (a started request of
		// 100): its next request waits behind a's, which goes first in
		// order but waits too, though AlikeLoad would take it.
		q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Most: 10, Load: 8, AlikeLoad: 16} })
		tb, err := q.Enter(context.Background(), "b", 1, 100, 4)
		if err != nil {
			t.Fatal(err)
		}
		tb.Started()
		for range 2 {
			if _, err := q.Enter(context.Background(), "a", 1, 4, 4); err != nil {
				t.Fatal(err)
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go q.Enter(ctx, "b", 1, 4, 4)
		for _, w := q.stats(); w < 1; _, w = q.stats() {
			if running, _ := q.stats(); running > 2 {
				t.Fatal("tenant b's request let in past Load beside tenant a's")
			}
			time.Sleep(time.Millisecond)
		}
		tctx, tcancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer tcancel()
		if turn, _ := q.Enter(tctx, "a", 1, 4, 4); turn != nil {
			t.Error("let in past Load while another tenant's request waits behind")
		}
	})
	t.Run("a waiting request of another priority", func(t *testing.T) {
		// Two of priority 1 in (load 8, the Load); one of priority 2
		// waits (not alike); the next of priority 1 goes first in order
		// but waits too, though AlikeLoad would take it.
		q := New(10, func(string) float64 { return 1 }, func() Limit { return Limit{Requests: 1, Most: 10, Load: 8, AlikeLoad: 16} })
		for range 2 {
			if _, err := q.Enter(context.Background(), "a", 1, 4, 4); err != nil {
				t.Fatal(err)
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go q.Enter(ctx, "a", 2, 4, 4)
		for _, w := q.stats(); w < 1; _, w = q.stats() {
			if running, _ := q.stats(); running > 2 {
				t.Fatal("a request of priority 2 let in past Load beside priority 1")
			}
			time.Sleep(time.Millisecond)
		}
		tctx, tcancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer tcancel()
		if turn, _ := q.Enter(tctx, "a", 1, 4, 4); turn != nil {
			t.Error("let in past Load while a request of another priority waits")
		}
	})
}
