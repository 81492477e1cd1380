package reply

import (
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
)

// replyBuffer bounds the messages held for one request. A client slower
// than the engine fills it; the overflow shows as a gap.
const replyBuffer = 4096

// The bytes held for one request are bounded too: a stream's, as a slow
// client lets them pile up; a whole answer's, which comes in parts of up
// to a message each, as large as the largest answer a worker relays
// whole. Past its first replyAllowance, what a request holds is counted
// in the gateway's budget (see [Replies.SetBudget]): a request that keeps
// up never meets the budget, and when slow clients have spent it, the
// one that needs more fails, not every other.
const (
	streamReplyBytes = 16 << 20
	MaxWholeAnswer   = 64 << 20
	wholeReplyBytes  = MaxWholeAnswer + 8<<20
	replyAllowance   = 1 << 20
)

// Budget is a count of bytes shared by every request of a gateway
// (PDQ_MAX_INFLIGHT_BYTES): what a reply queue holds is taken from it.
type Budget interface {
	// Take reserves n bytes, and reports whether they fit.
	Take(n int64) bool
	// Release gives n reserved bytes back.
	Release(n int64)
}

// replyQueue holds a request's replies until its relay reads them. It grows
// with what it holds (a channel of replyBuffer slots would take 32 KiB per
// request before any reply arrived), up to replyBuffer messages and its
// limit of bytes.
//
// push is called by Replies.deliver: on the reply subscription's
// goroutine, and in pdq up on the goroutines of the local writers, any
// number at once. pop and len are called by the stream's relay, one
// goroutine; close once the relay is done.
type replyQueue struct {
	// mu guards the fields below.
	mu    sync.Mutex
	msgs  []*nats.Msg
	head  int
	bytes int64 // the payloads held
	limit int64
	// closed is set by close: the queue takes nothing more.
	closed bool

	// Set by newReplyQueue, read without a lock.
	budget Budget        // nil: none
	ready  chan struct{} // a token once a push follows a drain
}

func newReplyQueue(budget Budget) *replyQueue {
	return &replyQueue{ready: make(chan struct{}, 1), limit: streamReplyBytes, budget: budget}
}

// push queues msg; false when the queue is full. A queue closed takes
// nothing more, and says it did.
func (q *replyQueue) push(msg *nats.Msg) bool {
	n := int64(len(msg.Data))
	q.mu.Lock()
	switch {
	case q.closed:
		q.mu.Unlock()
		return true
	case len(q.msgs)-q.head >= replyBuffer || q.bytes+n > q.limit || !q.take(n):
		q.mu.Unlock()
		return false
	}
	q.bytes += n
	q.msgs = append(q.msgs, msg)
	q.mu.Unlock()
	select {
	case q.ready <- struct{}{}:
	default:
	}
	return true
}

// pop takes the oldest reply, if any.
func (q *replyQueue) pop() (*nats.Msg, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.head == len(q.msgs) {
		return nil, false
	}
	msg := q.msgs[q.head]
	q.msgs[q.head] = nil
	q.head++
	q.giveBack(int64(len(msg.Data)))
	switch {
	case q.head == len(q.msgs) && cap(q.msgs) > 1024:
		q.msgs, q.head = nil, 0 // a burst is over: give its room back
	case q.head == len(q.msgs):
		q.msgs, q.head = q.msgs[:0], 0
	case q.head > 64 && q.head > len(q.msgs)/2:
		// A relay that stays a little behind never drains: move the rest
		// down so that the slice does not grow for ever.
		n := copy(q.msgs, q.msgs[q.head:])
		clear(q.msgs[n:])
		q.msgs, q.head = q.msgs[:n], 0
	}
	return msg, true
}

// take takes from the budget what n more bytes bring past the queue's
// allowance. q.mu is held.
func (q *replyQueue) take(n int64) bool {
	if over := q.bytes + n - replyAllowance; q.budget != nil && over > 0 {
		return q.budget.Take(min(over, n))
	}
	return true
}

// giveBack returns n bytes the queue held, and to the budget the part of
// them that was past its allowance. q.mu is held.
func (q *replyQueue) giveBack(n int64) {
	if over := q.bytes - replyAllowance; q.budget != nil && over > 0 {
		q.budget.Release(min(over, n))
	}
	q.bytes -= n
}

// close drops what the queue holds, its bytes given back, and takes
// nothing more.
func (q *replyQueue) close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	q.giveBack(q.bytes)
	q.msgs, q.head = nil, 0
}

// len is the number of replies held.
func (q *replyQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.msgs) - q.head
}

// LocalReplies holds the gateways of this process (`pdq up`) for its
// workers: a framed writer's reply to one of them goes straight into the
// request's reply queue instead of through the NATS server. A token over
// NATS is a message written, routed and parsed, and five goroutine
// hand-offs; here it is one hand-off. The messages are the same, in the
// order they are sent, and the gateway checks them as it does any; but
// none is lost on the way, so a beat or an end waits for no ack (a queue
// that overflows still shows as a gap). A nil *LocalReplies holds none.
//
// The gateways call Add, and its removal, as they start and stop; the
// workers' stage loops look a gateway up (gateway) for each writer they
// make, any number at once.
type LocalReplies struct {
	// mu guards the fields below.
	mu       sync.RWMutex
	gateways map[string]*Replies // by reply subject prefix
}

// NewLocalReplies returns an empty set.
func NewLocalReplies() *LocalReplies {
	return &LocalReplies{gateways: make(map[string]*Replies)}
}

// Add makes r's reply streams reachable by the writers made in this
// process until the returned function is called. A writer made before
// keeps r: what it hands r then goes nowhere, as it would over NATS to a
// gateway that has unsubscribed.
func (l *LocalReplies) Add(r *Replies) (remove func()) {
	if l == nil {
		return func() {}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gateways[r.prefix] = r
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.gateways[r.prefix] == r {
			delete(l.gateways, r.prefix)
		}
	}
}

// gateway is the local gateway of a reply subject, or nil.
func (l *LocalReplies) gateway(subject string) *Replies {
	i := strings.LastIndexByte(subject, '.')
	if l == nil || i < 0 {
		return nil
	}
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.gateways[subject[:i+1]]
}
