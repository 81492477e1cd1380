package dispatcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// ReplyWriter sends a request's reply to the gateway over core NATS: chunks
// numbered from 0, then one terminal message, done or error. Core NATS may
// drop messages (a slow consumer), so the numbering lets the gateway see a
// gap instead of silence. A writer without a subject (a replay, which has
// no client) keeps the chunks for the request record instead.
type ReplyWriter struct {
	nc      *nats.Conn
	subject string
	attempt string // formatted once: it goes on every message
	seq     int
	// stages go on the done message, for the gateway's request record.
	stages []StageRecord
	// kept holds the chunks of a writer without a subject, and failed its
	// error.
	kept   [][]byte
	failed *openai.Error
}

// NewReplyWriter writes to subject as the given attempt (see
// [ReplyAttempt]); an empty subject keeps the reply instead.
func NewReplyWriter(nc *nats.Conn, subject string, attempt int) *ReplyWriter {
	return &ReplyWriter{nc: nc, subject: subject, attempt: strconv.Itoa(attempt)}
}

// Sent is the number of chunks sent so far.
func (w *ReplyWriter) Sent() int { return w.seq }

// SetStages records the stage runs that the done message reports; the last
// one's duration is measured when Done is sent.
func (w *ReplyWriter) SetStages(stages ...StageRecord) { w.stages = stages }

// Chunk sends one chunk: an SSE event's data, or a whole JSON response.
func (w *ReplyWriter) Chunk(data []byte) error {
	if w.subject == "" {
		w.kept = append(w.kept, data)
		w.seq++
		return nil
	}
	if err := w.send(KindChunk, w.seq, data, 0, nil); err != nil {
		return err
	}
	w.seq++
	return nil
}

// Done ends the reply after the chunks sent.
func (w *ReplyWriter) Done() error {
	var stages []byte
	if n := len(w.stages); n > 0 {
		last := &w.stages[n-1]
		last.Ms = float64(time.Since(last.Started).Microseconds()) / 1000
		stages, _ = json.Marshal(w.stages) // plain fields: it always encodes
	}
	if w.subject == "" {
		return nil
	}
	return w.send(KindDone, w.seq, nil, 0, stages)
}

// Error ends the reply with an error to pass to the client.
func (w *ReplyWriter) Error(e *openai.Error) error {
	if w.subject == "" {
		w.failed = e
		return nil
	}
	body, err := json.Marshal(openai.ErrorResponse{Error: e})
	if err != nil {
		return fmt.Errorf("encode error reply: %w", err)
	}
	return w.send(KindError, w.seq, body, e.Status(), nil)
}

// Kept is what a writer without a subject kept: the chunks, and the stage
// runs.
func (w *ReplyWriter) Kept() ([][]byte, []StageRecord) { return w.kept, w.stages }

func (w *ReplyWriter) send(kind string, seq int, data []byte, status int, stages []byte) error {
	msg := nats.NewMsg(w.subject)
	msg.Header[HeaderKind] = []string{kind}
	msg.Header[HeaderSeq] = []string{strconv.Itoa(seq)}
	msg.Header[HeaderAttempt] = []string{w.attempt}
	if status != 0 {
		msg.Header[HeaderStatus] = []string{strconv.Itoa(status)}
	}
	if stages != nil {
		msg.Header[HeaderStages] = []string{string(stages)}
	}
	msg.Data = data
	if err := w.nc.PublishMsg(msg); err != nil {
		return fmt.Errorf("send %s reply to %s: %w", kind, w.subject, err)
	}
	return nil
}

// Reply is one message of a reply stream, as the gateway reads it.
type Reply struct {
	Kind string
	// Data is a chunk's payload, or an error's envelope.
	Data []byte
	// Status is an error's HTTP status.
	Status int
	// Stages are the stage runs a done message reports.
	Stages []StageRecord
}

// Errors of [ReplyStream.Next].
var (
	// ErrReplyGap means a chunk went missing: the reply cannot be trusted.
	ErrReplyGap = errors.New("reply chunks lost in transit")
	// ErrReplyRestarted means the decode restarted after chunks had already
	// gone to the client, who cannot be given a second beginning.
	ErrReplyRestarted = errors.New("decode restarted after output was sent")
	// ErrReplyTimeout means nothing arrived for the idle timeout.
	ErrReplyTimeout = errors.New("no reply from the workers in time")
	// ErrInFlight means a request with this id is already in flight here.
	ErrInFlight = errors.New("a request with this id is in flight")
)

// replyBuffer bounds the messages held for one request. A client slower
// than the engine fills it; the overflow shows as a gap.
const replyBuffer = 4096

// Replies is the gateway's end of the reply streams: one wildcard
// subscription on pdq.reply.<gateway>.>, fanned out to the requests that
// wait here.
type Replies struct {
	gatewayID string
	prefix    string // ReplySubject(gatewayID, ""), cut off every message
	sub       *nats.Subscription

	mu      sync.Mutex
	streams map[string]*ReplyStream
}

// NewReplies subscribes to the replies for gatewayID.
func NewReplies(nc *nats.Conn, gatewayID string) (*Replies, error) {
	r := &Replies{gatewayID: gatewayID, prefix: ReplySubject(gatewayID, ""), streams: make(map[string]*ReplyStream)}
	sub, err := nc.Subscribe(ReplySubject(gatewayID, "*"), r.dispatch)
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
func (r *Replies) Subject(id string) string { return ReplySubject(r.gatewayID, id) }

// Open registers a request before its job is submitted, so no reply can
// arrive unheard. It fails with ErrInFlight if the id is already open.
func (r *Replies) Open(id string) (*ReplyStream, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.streams[id]; ok {
		return nil, ErrInFlight
	}
	s := &ReplyStream{id: id, owner: r, ch: make(chan *nats.Msg, replyBuffer)}
	r.streams[id] = s
	return s, nil
}

func (r *Replies) dispatch(msg *nats.Msg) {
	id := msg.Subject[len(r.prefix):]
	r.mu.Lock()
	s := r.streams[id]
	r.mu.Unlock()
	if s == nil {
		return // the client is gone, or this is a late duplicate
	}
	select {
	case s.ch <- msg:
	default:
		s.overflow.Store(true)
	}
}

// ReplyStream is one request's reply, read in order.
type ReplyStream struct {
	id       string
	owner    *Replies
	ch       chan *nats.Msg
	overflow atomic.Bool
	attempt  int
	// next is the next chunk number; while no attempt has restarted after
	// output, it is also the number of chunks relayed.
	next int
	// idle is one timer for the whole stream: Next runs once per token.
	idle *time.Timer
}

// Close unregisters the request.
func (s *ReplyStream) Close() {
	if s.idle != nil {
		s.idle.Stop()
	}
	s.owner.mu.Lock()
	defer s.owner.mu.Unlock()
	if s.owner.streams[s.id] == s {
		delete(s.owner.streams, s.id)
	}
}

// Next returns the next reply in order: a chunk, or the terminal done or
// error. It fails on a gap, on a restart after output, when nothing comes
// for idle, or when ctx ends.
func (s *ReplyStream) Next(ctx context.Context, idle time.Duration) (Reply, error) {
	if s.idle == nil {
		s.idle = time.NewTimer(idle)
	} else {
		s.idle.Reset(idle) // Go 1.23+: no stale tick can be left in the channel
	}
	for {
		var msg *nats.Msg
		select {
		case msg = <-s.ch:
		case <-s.idle.C:
			return Reply{}, ErrReplyTimeout
		case <-ctx.Done():
			return Reply{}, ctx.Err()
		}
		if s.overflow.Load() {
			return Reply{}, fmt.Errorf("%w: the client reads slower than the engine writes", ErrReplyGap)
		}
		kind := msg.Header.Get(HeaderKind)
		attempt, _ := strconv.Atoi(msg.Header.Get(HeaderAttempt))
		seq, err := strconv.Atoi(msg.Header.Get(HeaderSeq))
		if err != nil {
			return Reply{}, fmt.Errorf("%w: reply without a sequence number", ErrReplyGap)
		}
		switch {
		case attempt < s.attempt:
			continue // from an attempt that was superseded
		case attempt > s.attempt:
			if s.next > 0 {
				return Reply{}, ErrReplyRestarted
			}
			s.attempt, s.next = attempt, 0
		}
		switch kind {
		case KindChunk:
			if seq != s.next {
				return Reply{}, fmt.Errorf("%w: chunk %d arrived, %d expected", ErrReplyGap, seq, s.next)
			}
			s.next++
			return Reply{Kind: KindChunk, Data: msg.Data}, nil
		case KindDone:
			if seq != s.next {
				return Reply{}, fmt.Errorf("%w: %d chunks sent, %d arrived", ErrReplyGap, seq, s.next)
			}
			done := Reply{Kind: KindDone}
			if raw := msg.Header.Get(HeaderStages); raw != "" {
				_ = json.Unmarshal([]byte(raw), &done.Stages) // informational: a bad one is left out
			}
			return done, nil
		case KindError:
			status, _ := strconv.Atoi(msg.Header.Get(HeaderStatus))
			return Reply{Kind: KindError, Data: msg.Data, Status: status}, nil
		}
		return Reply{}, fmt.Errorf("%w: unknown reply kind %q", ErrReplyGap, kind)
	}
}
