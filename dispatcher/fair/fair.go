package fair

import (
	"context"
	"errors"
	"math"
	"slices"
	"sync"
)

// ErrTenantFull refuses a request whose tenant holds its share of the
// queue already.
var ErrTenantFull = errors.New("the tenant's share of the queue is full")

// Queue decides, for one pool, which request goes into the queue next
// when the pool runs all it can: vLLM's priority first (lower first),
// then each tenant in turn, in proportion to its weight and the work its
// requests ask for (start-time fair queueing: a request's tags are where
// its tenant's work so far ends). Requests wait here, in the gateway, not
// in JetStream, whose queue is first in first out: one tenant's burst
// would sit in front of everyone's requests there. A pool is full when as
// many requests as the limit are let in and have not started (their first
// answer has not come: they wait for a prefill, run one, or wait for a
// decode's first step): from then on each request that starts, or ends
// before it started, lets the next in. A request that has started holds
// no turn, so that the limit bounds the work queued before the engines,
// where waiting costs the time to first token, and not the decodes.
//
// A tenant's waiting requests are bounded by its share of maxQueue
// (its weight among the tenants with requests here): a tenant that floods
// is refused (429) before anyone else is.
//
// Enter is called from any number of request goroutines at once; done
// functions from others.
type Queue struct {
	// Set by New, read without a lock. weight and limit are called with
	// mu held: they must not call back into the queue.
	maxQueue int
	weight   func(tenant string) float64
	limit    func() Limit

	// mu guards the fields below; a waiter's admitted channel is closed
	// under it.
	mu      sync.Mutex
	running int // let in, not started
	load    int // the load of those
	// priorities counts those by priority, for the bypass (Limit.Bypass).
	priorities map[int]int
	bypassing  int // let in by the bypass, not started
	waiting    []*waiter
	vtime      float64
	tenants    map[string]*tenantState
	arrivals   uint64
}

type tenantState struct {
	finish  float64 // where the tenant's work so far ends, in virtual time
	waiting int
	running int // let in, not ended
	turns   int // let in by the limit, not started
}

// Limit is what a pool may have let in and not started: a request goes in
// while fewer than Requests are, or, while fewer than Most are, if the
// load of those, with its own, is within Load (in the pool's unit: prompt
// tokens, for the gateway). The load bound lets many small requests in
// together, up to Most; the count lets a few large ones in, one of which
// alone would not pass the load bound.
//
// Bypass lets up to that many more in, not started, beside the limit: a
// request entered by EnterOrBypass that finds the pool full, goes first
// and outranks work let in (see bypassLocked: a better priority, or a
// tenant without a turn while another holds more than its share). Its
// Turn says so (Bypassed), for the caller to run it elsewhere than where
// the limit's requests wait: the gateway sends it decode-only (see
// gateway's fairQueue).
//
// AlikeLoad, when above Load, is the load bound while the request and
// every request let in and not started, or waiting, are of one tenant and
// one priority: there is no order to keep then, and the engines may batch
// what would otherwise wait here (see alikeLocked).
type Limit struct{ Requests, Most, Load, AlikeLoad, Bypass int }

// Turn is a request let in. Started and Done may be called from any
// goroutine, each any number of times: the first call counts.
type Turn struct {
	q        *Queue
	tenant   string
	load     int
	priority int
	bypassed bool
	// started and done are guarded by q.mu.
	started, done bool
}

// Bypassed says the request went in by the bypass (Limit.Bypass).
func (t *Turn) Bypassed() bool { return t.bypassed }

type waiter struct {
	tenant        string
	priority      int
	load          int
	seq           uint64
	start, finish float64
	mayBypass     bool
	admitted      chan struct{}
	turn          *Turn // set as it is admitted
}

// New makes a pool's queue. maxQueue bounds the requests waiting in it,
// weight gives a tenant's weight (0 for the default, 1), and limit what
// may be let in and not started; both are called with the queue's lock
// held.
func New(maxQueue int, weight func(string) float64, limit func() Limit) *Queue {
	return &Queue{maxQueue: maxQueue, weight: weight, limit: limit, tenants: make(map[string]*tenantState), priorities: make(map[int]int)}
}

// Enter waits until the request may go into the queue, and returns its
// turn, to be told when the request starts and when it ends. cost is its
// work, which its tenant's share counts (prompt and output tokens); load
// what it holds of the pool's limit until it starts (its prompt tokens).
// It fails with ErrTenantFull when the tenant's share of the queue is
// taken, or with ctx's error.
func (q *Queue) Enter(ctx context.Context, tenant string, priority, cost, load int) (*Turn, error) {
	return q.enter(ctx, tenant, priority, cost, load, false)
}

// EnterOrBypass is Enter for a request that may go in by the bypass
// (Limit.Bypass): one its caller can run elsewhere than the limit's.
func (q *Queue) EnterOrBypass(ctx context.Context, tenant string, priority, cost, load int) (*Turn, error) {
	return q.enter(ctx, tenant, priority, cost, load, true)
}

func (q *Queue) enter(ctx context.Context, tenant string, priority, cost, load int, mayBypass bool) (*Turn, error) {
	q.mu.Lock()
	t := q.tenants[tenant]
	if t == nil {
		t = &tenantState{}
		q.tenants[tenant] = t
	}
	w := &waiter{tenant: tenant, priority: priority, load: max(load, 1), seq: q.arrivals, mayBypass: mayBypass, admitted: make(chan struct{})}
	q.arrivals++
	w.start = math.Max(q.vtime, t.finish)
	w.finish = w.start + float64(max(cost, 1))/q.weightOf(tenant)
	// The limit is read once a decision: it follows the registry, and
	// may change between two reads.
	limit := q.limit()
	fits := q.fitsLocked(limit, w)
	if len(q.waiting) == 0 && fits || !fits && q.bypassLocked(w, limit) {
		t.finish = w.finish
		q.vtime = math.Max(q.vtime, w.start)
		turn := q.admitLocked(w, t, !fits)
		q.mu.Unlock()
		return turn, nil
	}
	if t.waiting >= q.shareLocked(tenant) {
		q.dropIfIdleLocked(tenant, t)
		q.mu.Unlock()
		return nil, ErrTenantFull
	}
	t.finish = w.finish
	t.waiting++
	q.waiting = append(q.waiting, w)
	// It may go first, and fit where the one it passes does not (a better
	// priority, a smaller load).
	q.dispatchLocked()
	q.mu.Unlock()

	select {
	case <-w.admitted:
		return w.turn, nil
	case <-ctx.Done():
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	select {
	case <-w.admitted: // let in as it gave up: it ends at once
		w.turn.endLocked()
	default:
		q.waiting = slices.DeleteFunc(q.waiting, func(x *waiter) bool { return x == w })
		t.waiting--
		q.dropIfIdleLocked(tenant, t)
		q.dispatchLocked() // it may have held back the next, which fits
	}
	return nil, ctx.Err()
}

// Started says the request's first answer came: it no longer holds a
// turn, and the next request may go in.
func (t *Turn) Started() {
	t.q.mu.Lock()
	defer t.q.mu.Unlock()
	t.startLocked()
}

// Done says the request ended; one that had not started starts too.
func (t *Turn) Done() {
	t.q.mu.Lock()
	defer t.q.mu.Unlock()
	t.endLocked()
}

func (t *Turn) startLocked() {
	if t.started {
		return
	}
	t.started = true
	if t.bypassed {
		t.q.bypassing--
	} else {
		t.q.running--
		t.q.load -= t.load
		if t.q.priorities[t.priority]--; t.q.priorities[t.priority] == 0 {
			delete(t.q.priorities, t.priority)
		}
		t.q.tenants[t.tenant].turns-- // kept until its turn ends (dropIfIdleLocked)
	}
	t.q.dispatchLocked()
}

func (t *Turn) endLocked() {
	if t.done {
		return
	}
	t.done = true
	t.startLocked()
	ts := t.q.tenants[t.tenant]
	ts.running--
	t.q.dropIfIdleLocked(t.tenant, ts)
}

// dispatchLocked lets waiting requests in while the pool has room: the
// lowest priority value, then the smallest start tag, then the earliest.
func (q *Queue) dispatchLocked() {
	for len(q.waiting) > 0 {
		i := 0
		for j, w := range q.waiting[1:] {
			if before(w, q.waiting[i]) {
				i = j + 1
			}
		}
		w := q.waiting[i]
		limit := q.limit()
		fits := q.fitsLocked(limit, w)
		if !fits && !q.bypassLocked(w, limit) {
			return // the next in order waits; none passes it
		}
		q.waiting = slices.Delete(q.waiting, i, i+1)
		t := q.tenants[w.tenant]
		t.waiting--
		q.vtime = math.Max(q.vtime, w.start)
		q.admitLocked(w, t, !fits)
	}
}

func before(a, b *waiter) bool {
	if a.priority != b.priority {
		return a.priority < b.priority
	}
	if a.start != b.start {
		return a.start < b.start
	}
	return a.seq < b.seq
}

// fitsLocked says whether w fits in limit, with the requests let in and
// not started.
func (q *Queue) fitsLocked(l Limit, w *waiter) bool {
	switch {
	case q.running < l.Requests:
		return true
	case q.running >= l.Most:
		return false
	case q.load+w.load <= l.Load:
		return true
	}
	return q.load+w.load <= l.AlikeLoad && q.alikeLocked(w)
}

// alikeLocked says whether w and every request let in and not started,
// or waiting, are of one tenant and one priority. Their order here is
// first come first served then, as in an engine's queue, so the limit
// need not keep them here: more in the engines lets them batch prompts a
// step (an engine step's fixed cost shared), and hides the hand-off from
// one request to the next. A request of another tenant or priority, let
// in or waiting, even one that goes after w, puts Load back: what goes in
// beyond Load must start before that request can, so the extra is taken
// only while nobody else waits for it. What was let in runs on, and the
// bypass takes what outranks it.
func (q *Queue) alikeLocked(w *waiter) bool {
	for p := range q.priorities {
		if p != w.priority {
			return false
		}
	}
	for name, t := range q.tenants {
		if name != w.tenant && (t.turns > 0 || t.waiting > 0) {
			return false
		}
	}
	for _, o := range q.waiting {
		if o.priority != w.priority {
			return false
		}
	}
	return true
}

// bypassLocked says whether w, which the limit leaves out, goes in by the
// bypass (Limit.Bypass): it goes first, and it outranks a request let in,
// by a better priority than one's while no turn has a better one than
// its own, or, at a priority no worse than any of theirs, as
// its tenant holds none of the turns while another holds a whole turn
// more than its weight's share of them (the tenants present sharing
// them): many tenants a turn each do not bypass one another.
func (q *Queue) bypassLocked(w *waiter, limit Limit) bool {
	if !w.mayBypass || q.bypassing >= limit.Bypass {
		return false
	}
	for _, o := range q.waiting {
		if o != w && before(o, w) {
			return false
		}
	}
	for p := range q.priorities {
		if p < w.priority {
			return false // a turn of a better priority: it would have gone first
		}
	}
	for p := range q.priorities {
		if p > w.priority {
			return true
		}
	}
	if t := q.tenants[w.tenant]; t != nil && t.turns > 0 {
		return false
	}
	total := 0.0
	for name, t := range q.tenants {
		if name == w.tenant || t.waiting > 0 || t.running > 0 {
			total += q.weightOf(name)
		}
	}
	// The turns let in: at least Requests, as w does not fit, and more
	// where the load bound let small prompts in beyond them.
	turns := float64(q.running)
	for name, t := range q.tenants {
		if name != w.tenant && float64(t.turns) >= turns*q.weightOf(name)/total+1 {
			return true
		}
	}
	return false
}

// admitLocked lets w in, by the limit or by the bypass, and returns its
// turn (also in w.turn).
func (q *Queue) admitLocked(w *waiter, t *tenantState, bypassed bool) *Turn {
	w.turn = &Turn{q: q, tenant: w.tenant, load: w.load, priority: w.priority}
	if bypassed {
		w.turn.bypassed = true
		q.bypassing++
	} else {
		q.running++
		q.load += w.load
		q.priorities[w.priority]++
		t.turns++
	}
	t.running++
	close(w.admitted)
	return w.turn
}

// shareLocked is how many requests tenant may have waiting: its weight's
// share of maxQueue among the tenants with requests here (itself
// included), at least 1.
func (q *Queue) shareLocked(tenant string) int {
	total := 0.0
	for name, t := range q.tenants {
		if name == tenant || t.waiting > 0 || t.running > 0 {
			total += q.weightOf(name)
		}
	}
	return max(1, int(float64(q.maxQueue)*q.weightOf(tenant)/total))
}

func (q *Queue) weightOf(tenant string) float64 {
	if w := q.weight(tenant); w > 0 {
		return w
	}
	return 1
}

// dropIfIdleLocked forgets a tenant with nothing here, so that the tenants
// kept are those present (the body's user names as many as clients like).
// Back, it starts level with the others, as start-time fair queueing
// starts a tenant that was idle.
func (q *Queue) dropIfIdleLocked(tenant string, t *tenantState) {
	if t.waiting == 0 && t.running == 0 {
		delete(q.tenants, tenant)
	}
}

// tenantsKept is how many tenants the queue remembers, for tests.
func (q *Queue) tenantsKept() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.tenants)
}

// stats are the requests let in and not started, and those waiting, for
// tests.
func (q *Queue) stats() (running, waiting int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.running, len(q.waiting)
}
