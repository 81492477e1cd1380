package submit

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
)

// depthTTL is how long the gateway trusts one look at a queue's depth. A
// look is a JetStream API request: from depthRenew on it is renewed in
// the background, so that under steady traffic no request waits for one
// (and the looks come about as often as when each was waited for); a
// request waits only for a look that would otherwise be served past
// depthTTL (the first, or after a lull).
const (
	depthTTL   = 100 * time.Millisecond
	depthRenew = depthTTL * 3 / 4
)

// QueueFullError is ErrQueueFull with what a client should hear: how long
// to wait before it retries, derived from the depth.
type QueueFullError struct {
	Pool       string
	Stage      dispatcher.Stage
	Depth      int
	RetryAfter time.Duration
}

func (e *QueueFullError) Error() string {
	return fmt.Sprintf("the %s queue of pool %s holds %d jobs, its bound", e.Stage, e.Pool, e.Depth)
}

// Unwrap makes the error match ErrQueueFull.
func (e *QueueFullError) Unwrap() error { return dispatcher.ErrQueueFull }

// Admission bounds the queue of each pool and stage, so that one model's
// backlog cannot fill the streams that all models share: a job is refused,
// never an older one dropped.
//
// The gateway's request handlers call Check, any number at once; a depth
// due for renewal is read again in a goroutine of its own (look), behind
// the caller.
type Admission struct {
	// Set by NewAdmission (now is a test's clock), read without a lock.
	js  jetstream.StreamManager
	max int
	now func() time.Time

	// mu guards depth. The JetStream call of a look is made with mu free.
	mu    sync.Mutex
	depth map[string]depthLook
}

type depthLook struct {
	n        int
	at       time.Time
	renewing bool // a background look is under way
}

// NewAdmission bounds each pool's stage queue at max jobs.
func NewAdmission(js jetstream.StreamManager, max int) *Admission {
	return &Admission{js: js, max: max, now: time.Now, depth: make(map[string]depthLook)}
}

// Check refuses a job for stage and pool with a *QueueFullError when the
// queue is at its bound. slots gives the pool's worker slots for the
// stage, which set the suggested wait; it is asked only on a refusal. A
// depth it cannot read admits the job: the stream's own bound still holds.
func (a *Admission) Check(ctx context.Context, stage dispatcher.Stage, pool string, slots func() int) error {
	n := a.read(ctx, stage, pool)
	if n < a.max {
		return nil
	}
	// Each slot takes one job at a time: the queue moves about a slot's
	// worth of jobs per job duration, taken as a second.
	wait := time.Duration(1+n/max(slots(), 1)) * time.Second
	return &QueueFullError{Pool: pool, Stage: stage, Depth: n, RetryAfter: min(wait, time.Minute)}
}

func (a *Admission) read(ctx context.Context, stage dispatcher.Stage, pool string) int {
	key := string(stage) + "/" + pool
	a.mu.Lock()
	look, ok := a.depth[key]
	age := a.now().Sub(look.at)
	if ok && age < depthTTL {
		if age >= depthRenew && !look.renewing {
			look.renewing = true
			a.depth[key] = look
			go a.look(context.WithoutCancel(ctx), key, stage, pool)
		}
		a.mu.Unlock()
		return look.n
	}
	a.mu.Unlock()
	return a.look(ctx, key, stage, pool)
}

// look reads the depth of the stage's queue for pool and keeps it under
// key, unless a look begun later is kept already. A depth it cannot read
// is the last one read, or 0 (admit: the stream's own bound still holds).
func (a *Admission) look(ctx context.Context, key string, stage dispatcher.Stage, pool string) int {
	at := a.now()
	depth, err := dispatcher.QueueDepth(ctx, a.js, stage, pool) // the engines' consumers too (affinity)
	a.mu.Lock()
	defer a.mu.Unlock()
	kept := a.depth[key]
	n := kept.n
	if err == nil {
		n = depth
	}
	if kept.at.After(at) {
		return n // a later look is kept: this one is only the caller's
	}
	a.depth[key] = depthLook{n: n, at: at}
	return n
}
