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
// would sit in front of everyone's requests there. A pool is full when it
// runs as many requests as its workers have seats (the limit); from
// then on each request that ends lets the next in.
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
	limit    func() int

	// mu guards the fields below; a waiter's admitted channel is closed
	// under it.
	mu       sync.Mutex
	running  int
	waiting  []*waiter
	vtime    float64
	tenants  map[string]*tenantState
	arrivals uint64
}

type tenantState struct {
	finish  float64 // where the tenant's work so far ends, in virtual time
	waiting int
	running int
}

type waiter struct {
	tenant        string
	priority      int
	seq           uint64
	start, finish float64
	admitted      chan struct{}
}

// New makes a pool's queue. maxQueue bounds the requests waiting in it,
// weight gives a tenant's weight (0 for the default, 1), and limit how
// many requests the pool runs at once; both are called with the queue's
// lock held.
func New(maxQueue int, weight func(string) float64, limit func() int) *Queue {
	return &Queue{maxQueue: maxQueue, weight: weight, limit: limit, tenants: make(map[string]*tenantState)}
}

// Enter waits until the request may go into the queue, and returns the
// function to call when it ends. cost is its work (prompt and output
// tokens). It fails with ErrTenantFull when the tenant's share of the
// queue is taken, or with ctx's error.
func (q *Queue) Enter(ctx context.Context, tenant string, priority, cost int) (done func(), err error) {
	q.mu.Lock()
	t := q.tenants[tenant]
	if t == nil {
		t = &tenantState{}
		q.tenants[tenant] = t
	}
	w := &waiter{tenant: tenant, priority: priority, seq: q.arrivals, admitted: make(chan struct{})}
	q.arrivals++
	w.start = math.Max(q.vtime, t.finish)
	w.finish = w.start + float64(max(cost, 1))/q.weightOf(tenant)
	if len(q.waiting) == 0 && q.running < q.limit() {
		t.finish = w.finish
		q.vtime = w.start
		q.admitLocked(w, t)
		q.mu.Unlock()
		return q.doneFunc(tenant), nil
	}
	if t.waiting >= q.shareLocked(tenant) {
		q.dropIfIdleLocked(tenant, t)
		q.mu.Unlock()
		return nil, ErrTenantFull
	}
	t.finish = w.finish
	t.waiting++
	q.waiting = append(q.waiting, w)
	q.mu.Unlock()

	select {
	case <-w.admitted:
		return q.doneFunc(tenant), nil
	case <-ctx.Done():
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	select {
	case <-w.admitted: // let in as it gave up: it ends at once
		q.endLocked(tenant)
	default:
		q.waiting = slices.DeleteFunc(q.waiting, func(x *waiter) bool { return x == w })
		t.waiting--
		q.dropIfIdleLocked(tenant, t)
	}
	return nil, ctx.Err()
}

func (q *Queue) doneFunc(tenant string) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			q.mu.Lock()
			defer q.mu.Unlock()
			q.endLocked(tenant)
		})
	}
}

// endLocked ends a running request and lets the next ones in.
func (q *Queue) endLocked(tenant string) {
	q.running--
	t := q.tenants[tenant]
	t.running--
	q.dropIfIdleLocked(tenant, t)
	q.dispatchLocked()
}

// dispatchLocked lets waiting requests in while the pool has room: the
// lowest priority value, then the smallest start tag, then the earliest.
func (q *Queue) dispatchLocked() {
	for len(q.waiting) > 0 && q.running < q.limit() {
		i := 0
		for j, w := range q.waiting[1:] {
			if before(w, q.waiting[i]) {
				i = j + 1
			}
		}
		w := q.waiting[i]
		q.waiting = slices.Delete(q.waiting, i, i+1)
		t := q.tenants[w.tenant]
		t.waiting--
		q.vtime = math.Max(q.vtime, w.start)
		q.admitLocked(w, t)
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

func (q *Queue) admitLocked(w *waiter, t *tenantState) {
	q.running++
	t.running++
	close(w.admitted)
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

// stats are the requests running and waiting, for tests and metrics.
func (q *Queue) stats() (running, waiting int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.running, len(q.waiting)
}
