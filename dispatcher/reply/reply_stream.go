package reply

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
)

// Replies is the gateway's end of the reply streams: one wildcard
// subscription on pdq.reply.<gateway>.>, fanned out to the requests that
// wait here.
//
// dispatch and deliver run on the subscription's goroutine and, in pdq
// up, on the goroutines of the local writers (a job's handler, its
// beats), any number at once. Request handlers call Open, Subject and
// Stream.Close, any number at once.
type Replies struct {
	// Set by NewReplies (sub once it has subscribed), read without a lock.
	gatewayID string
	prefix    string // ReplySubject(gatewayID, ""), cut off every message
	sub       *nats.Subscription
	// budget counts the bytes the streams hold (SetBudget); nil counts
	// none. Set before the first Open, read by Open.
	budget Budget

	// mu guards the fields below. It is read-locked once per reply
	// message, by the subscription and, in pdq up, by every worker
	// goroutine that relays a stream; Open and Stream.Close
	// write-lock it.
	mu      sync.RWMutex
	streams map[string]*Stream
}

// SetBudget counts the bytes the reply queues hold in budget, before any
// stream is opened: a reply that does not fit is a gap, and fails its
// request.
func (r *Replies) SetBudget(b Budget) { r.budget = b }

// NewReplies subscribes to the replies for gatewayID.
func NewReplies(nc *nats.Conn, gatewayID string) (*Replies, error) {
	r := &Replies{gatewayID: gatewayID, prefix: dispatcher.ReplySubject(gatewayID, ""), streams: make(map[string]*Stream)}
	sub, err := nc.Subscribe(dispatcher.ReplySubject(gatewayID, "*"), r.dispatch)
	if err != nil {
		return nil, fmt.Errorf("subscribe to replies: %w", err)
	}
	// Replies are small and frequent; give the subscription room before
	// the client library calls it a slow consumer.
	if err := sub.SetPendingLimits(1<<20, 256<<20); err != nil {
		return nil, fmt.Errorf("set reply pending limits: %w", err)
	}
	r.sub = sub
	return r, nil
}

// Close stops the subscription.
func (r *Replies) Close() error { return r.sub.Unsubscribe() }

// Subject is the reply subject for request id.
func (r *Replies) Subject(id string) string { return dispatcher.ReplySubject(r.gatewayID, id) }

// Open registers a request before its job is submitted, so no reply can
// arrive unheard. It fails with ErrInFlight if the id is already open.
func (r *Replies) Open(id string) (*Stream, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.streams[id]; ok {
		return nil, ErrInFlight
	}
	s := &Stream{id: id, owner: r, q: newReplyQueue(r.budget)}
	r.streams[id] = s
	return s, nil
}

func (r *Replies) dispatch(msg *nats.Msg) {
	switch d := r.deliver(msg); {
	case d == delivered:
	case d == superseded:
		ackGone(msg, GoneSuperseded)
	case msg.Header.Get(dispatcher.HeaderKind) == dispatcher.KindBeat:
		// The request has ended here (answered, or given up): a worker
		// that beats is told to stop.
		ackGone(msg, GoneClosed)
	default:
		// One that ends is told it has nothing more to send.
		ack(msg, msg.Header.Get(dispatcher.HeaderSeq))
	}
}

// What became of a reply message the gateway was handed.
type delivery int

const (
	delivered  delivery = iota // queued for the request that waits for it
	closed                     // no request waits for it: ended here
	superseded                 // a beat of an attempt older than the one the request follows
)

// deliver queues msg for the request that waits for it, and says whether
// one does.
func (r *Replies) deliver(msg *nats.Msg) delivery {
	id := msg.Subject[len(r.prefix):]
	r.mu.RLock()
	s := r.streams[id]
	r.mu.RUnlock()
	if s == nil {
		return closed
	}
	if msg.Header.Get(dispatcher.HeaderKind) == dispatcher.KindBeat {
		if a, err := strconv.Atoi(msg.Header.Get(dispatcher.HeaderAttempt)); err == nil && int64(a) < s.latest.Load() {
			return superseded
		}
	}
	if !s.q.push(msg) {
		s.overflow.Store(true)
	}
	return delivered
}

// Stream is one request's reply, read in order.
//
// A stream is used by one goroutine at a time: the request's handler,
// which in a batch hands each prompt's stream to a reader goroutine of its
// own and closes it once the readers are done. Start, Whole, OnIdle,
// OnStarted, OnPrefilledOn, Next, Heard, Rearm, Generation and Close are
// that goroutine's; attempt, next, moved, base, heard, stall, idle,
// onStarted, onPrefilledOn and pending are read and written by it only,
// without a lock. Replies.deliver, on
// other goroutines, uses only q, overflow and latest.
type Stream struct {
	// Set by Open, read without a lock.
	id    string
	owner *Replies
	q     *replyQueue // has its own lock
	// overflow is set by deliver when q is full, and read by Next: an
	// atomic, so that deliver takes no lock of the stream's.
	overflow atomic.Bool
	attempt  int
	// latest is attempt, for writers in this process (see Replies.deliver):
	// the relay stores it, deliver loads it.
	latest atomic.Int64
	// next is the next chunk number: the number of chunks relayed.
	next int
	// moved means the current attempt handed the reply on at next; a later
	// attempt continues it from there.
	moved bool
	// base is the chunk the current attempt started at: 0, or where a
	// migrated decode took over. An attempt that sent nothing past it may
	// be followed by a later one.
	base int
	// heard means a decode of the current attempt has been heard from: from
	// then on, silence for the stall time-out fails the request; before,
	// it is a queue's.
	heard bool
	// stall is one timer for the whole stream: Next runs once per token.
	stall *time.Timer
	// idle runs before Next waits (OnIdle).
	idle func() error
	// onStarted run as a prefill ends or a decode is heard from (OnStarted).
	onStarted []func()
	// onPrefilledOn run as a prefill ends, with its engine (OnPrefilledOn).
	onPrefilledOn []func(engine string)
	// pending are the chunks of a batched message not returned yet.
	pending [][]byte
}

// Start makes the stream follow the reply of the request's generation,
// once its submit has set it: a writer of an earlier generation (the
// decode of an earlier request under this id, still running after its
// client left) is not this request's, and is told it is gone.
func (s *Stream) Start(generation int) {
	s.attempt = dispatcher.ReplyAttempt(generation, 0)
	s.latest.Store(int64(s.attempt))
}

// Close unregisters the request, and gives back the bytes its replies
// held.
func (s *Stream) Close() {
	if s.stall != nil {
		s.stall.Stop()
	}
	s.owner.mu.Lock()
	if s.owner.streams[s.id] == s {
		delete(s.owner.streams, s.id)
	}
	s.owner.mu.Unlock()
	s.q.close()
}

// Whole bounds the stream's bytes as a whole answer's, which comes in
// parts up to the largest a worker relays, rather than a stream's.
func (s *Stream) Whole() {
	s.q.mu.Lock()
	s.q.limit = wholeReplyBytes
	s.q.mu.Unlock()
}

// Generation is the generation of the attempt the stream follows.
func (s *Stream) Generation() int { return s.attempt >> 8 }

// Heard reports whether a decode of the current attempt has been heard
// from.
func (s *Stream) Heard() bool { return s.heard }

// OnIdle sets f to be called whenever Next is about to wait for a reply:
// a relay that writes without flushing flushes there, once per burst of
// replies instead of once per reply. Next fails, wrapping ErrIdle, when f
// does.
func (s *Stream) OnIdle(f func() error) { s.idle = f }

// OnStarted adds f to the functions called, on Next's goroutine, whenever
// a prefill of the request ends (dispatcher.KindPrefilled) or a decode of
// it is first heard from (its first beat, chunk or end; again after
// Rearm): it no longer waits for an engine's first stage. f may be called
// more than once.
func (s *Stream) OnStarted(f func()) { s.onStarted = append(s.onStarted, f) }

// OnPrefilledOn adds f to the functions called, on Next's goroutine, when
// a prefill of the request ends, with the key of the engine that ran it
// (dispatcher.EngineKey), when its worker said.
func (s *Stream) OnPrefilledOn(f func(engine string)) {
	s.onPrefilledOn = append(s.onPrefilledOn, f)
}

func (s *Stream) started() {
	for _, f := range s.onStarted {
		f()
	}
}

// ErrIdle wraps the error of the OnIdle function.
var ErrIdle = errors.New("writing the replies so far failed")

// Rearm forgets the decode heard so far, for a request that went back to
// prefill: until a decode of it is heard again, silence is expected.
func (s *Stream) Rearm() { s.heard = false }

// Next returns the next reply in order: a chunk, or the terminal done or
// error. Chunks lost in transit are asked for again; Next fails on a
// restart after output, when nothing comes for stall (ErrStalled:
// the caller decides by Heard whether that is a silent decode or a queue),
// or when ctx ends.
func (s *Stream) Next(ctx context.Context, stall time.Duration) (Reply, error) {
	if len(s.pending) > 0 {
		data := s.pending[0]
		s.pending = s.pending[1:]
		return Reply{Kind: dispatcher.KindChunk, Data: data}, nil
	}
	if s.stall == nil {
		s.stall = time.NewTimer(stall)
	}
	// The stall window starts with this call, and again at each sign of
	// progress; the timer is set only when Next is about to wait, not at
	// each of those (once per token, not three times).
	owed := true
	for {
		msg, ok := s.q.pop()
		if !ok {
			// Nothing more at hand: the caller's output goes out before
			// the wait.
			if s.idle != nil {
				if err := s.idle(); err != nil {
					return Reply{}, fmt.Errorf("%w: %w", ErrIdle, err)
				}
				// A flush to a slow client is no silence of the decode's:
				// the wait starts now.
				owed = true
			}
			if owed {
				s.stall.Reset(stall) // Go 1.23+: no stale tick can be left in the channel
				owed = false
			}
			select {
			case <-s.q.ready:
				continue
			case <-s.stall.C:
				if s.q.len() > 0 {
					continue // it came as the timer fired
				}
				return Reply{}, ErrStalled
			case <-ctx.Done():
				return Reply{}, ctx.Err()
			}
		}
		if s.overflow.Load() {
			return Reply{}, fmt.Errorf("%w: %w", ErrGap, ErrOverflow)
		}
		kind, attempt, seq, count, data, err := replyOf(msg)
		if err != nil {
			return Reply{}, err
		}
		if kind == dispatcher.KindPrefilled {
			// The request no longer waits for a prefill engine; nor is a
			// decode heard from: the wait for one is still a queue's.
			if !s.heard && attempt>>8 == s.attempt>>8 {
				s.started()
			}
			// A later generation's prefill (a decode failed before
			// its output, and the request went back) ran the same
			// prompt: its engine is learned too.
			if attempt>>8 >= s.attempt>>8 && len(data) > 0 {
				for _, f := range s.onPrefilledOn {
					f(string(data))
				}
			}
			continue
		}
		switch {
		case attempt < s.attempt && kind == dispatcher.KindBeat:
			ackGone(msg, GoneSuperseded) // a superseded writer still running: it stops
			continue
		case attempt < s.attempt:
			ack(msg, strconv.Itoa(seq)) // a superseded writer: let it go
			continue
		case attempt > s.attempt:
			switch {
			case s.moved:
				s.base = s.next
			case s.next > s.base:
				return Reply{}, ErrRestarted
			}
			s.attempt, s.moved = attempt, false
			s.latest.Store(int64(attempt))
		}
		if !s.heard || kind == dispatcher.KindBeat || (kind == dispatcher.KindChunk && seq <= s.next && s.next < seq+count) {
			owed = true // a sign of life, or progress
		}
		if !s.heard {
			s.started()
		}
		s.heard = true
		switch kind {
		case dispatcher.KindBeat:
			ack(msg, strconv.Itoa(s.next))
			continue
		case dispatcher.KindChunk:
			if seq > s.next || seq+count <= s.next {
				continue // a duplicate, or past a gap the next ack fills
			}
			if count == 1 {
				s.next++
				return Reply{Kind: dispatcher.KindChunk, Data: data}, nil
			}
			parts := bytes.Split(data, newline)
			if len(parts) != count {
				return Reply{}, fmt.Errorf("%w: %d chunks in a message that says %d", ErrGap, len(parts), count)
			}
			parts = parts[s.next-seq:] // what came before is here already
			s.next += len(parts)
			s.pending = parts[1:]
			return Reply{Kind: dispatcher.KindChunk, Data: parts[0]}, nil
		case dispatcher.KindMoved, dispatcher.KindDone:
			ack(msg, strconv.Itoa(s.next))
			if seq > s.next {
				continue // the writer sends what is missing, then ends again
			}
			if seq < s.next {
				return Reply{}, fmt.Errorf("%w: %d chunks sent, %d arrived", ErrGap, seq, s.next)
			}
			if kind == dispatcher.KindMoved {
				s.moved = true
				continue
			}
			done := Reply{Kind: dispatcher.KindDone}
			if raw := msg.Header.Get(dispatcher.HeaderStages); raw != "" {
				_ = json.Unmarshal([]byte(raw), &done.Stages) // informational: a bad one is left out
			}
			return done, nil
		case dispatcher.KindError:
			ack(msg, strconv.Itoa(seq))
			status, _ := strconv.Atoi(msg.Header.Get(dispatcher.HeaderStatus))
			return Reply{Kind: dispatcher.KindError, Data: data, Status: status}, nil
		}
		return Reply{}, fmt.Errorf("%w: unknown reply kind %q", ErrGap, kind)
	}
}
