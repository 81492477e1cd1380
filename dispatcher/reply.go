package dispatcher

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// ReplyWriter sends a request's reply to the gateway over core NATS: chunks
// numbered from 0, then one terminal message, done or error. Core NATS may
// lose messages (a slow consumer, a server restart), so nothing is taken
// as delivered until the gateway says so: the writer keeps the chunks, a
// running decode beats (see [ReplyWriter.Beats]), and the gateway answers
// each beat and the end with the number of chunks it has; the writer sends
// again whatever is missing. A writer without a subject (a replay, which
// has no client) keeps the chunks for the request record instead.
//
// A chunk message carries its kind, number and attempt in NATS headers, or,
// for a gateway that reads them (Job.ReplyFramed), in a frame line before
// its data and no headers at all: "<attempt> <seq> <count>\n". Chunks are
// most of a reply's messages, one per token or burst, and a gateway's NATS
// client parses every message's headers into a map; the frame costs a
// few bytes to write and nothing to skip. Other kinds keep their headers.
//
// A writer whose gateway runs in the same process hands it the messages
// instead (see [LocalReplies]).
//
// A writer belongs to the goroutine of the job's handler, which calls
// Chunk, Chunks, Whole, Done, Moved, Error, SetStages and Kept, one at a
// time. Beats starts the one other goroutine that uses it: beat shares
// seq, base and kept with the sends, under mu. Sent and Own may be called
// from any goroutine.
type ReplyWriter struct {
	// Set before the writer is shared (by NewReplyWriter, and Frame,
	// Local, SetEndWait and Watch before Beats starts), read without a
	// lock.
	nc      *nats.Conn
	subject string
	// local is the gateway of subject when it runs in this process: the
	// messages are put in its queue, not published (see [LocalReplies]).
	local    *Replies
	attempt  []string // the attempt header's value, made once: it goes on every message
	attemptN int
	framed   bool
	// endWait bounds the wait for the gateway's ack of the end.
	endWait time.Duration

	// mu guards the fields below. A beat hands a local gateway its
	// message under mu, so that it comes after the chunks it counts.
	mu sync.Mutex
	// seq is the number of chunks sent; kept holds the ones from base on,
	// which the gateway has not acknowledged (all of them without a
	// subject; none for a local gateway, which has them all, so base is
	// seq). The first start were sent by earlier generations. Kept reads
	// kept without mu: a writer without a subject has no beats.
	seq, base, start int
	kept             [][]byte

	// The handler's goroutine only, without a lock: stages go on the done
	// message, for the gateway's request record; failed is the error of a
	// writer without a subject.
	stages []StageRecord
	failed *openai.Error

	// gone is called once when the gateway says it no longer holds the
	// request; wanted, when a beat gets no answer, says whether the
	// request still wants this writer's work (see Watch). Set by Watch
	// before Beats starts; gone is called from the beats' goroutine.
	gone     func(cause error)
	goneOnce sync.Once
	wanted   func(context.Context) bool
}

// Errors of a [ReplyWriter]'s end.
var (
	// ErrReplyUnacked means the gateway did not acknowledge the end within
	// the writer's wait: it is gone, or cut off from NATS. Its own stall
	// timer answers the client.
	ErrReplyUnacked = errors.New("the gateway did not acknowledge the reply")
)

// DefaultEndWait is how long a writer waits for the gateway to acknowledge
// the end of a reply.
const DefaultEndWait = 10 * time.Second

// ackTimeout is the wait for one ack; the end is sent again after it.
const ackTimeout = time.Second

// NewReplyWriter writes to subject as the given attempt (see
// [ReplyAttempt]); an empty subject keeps the reply instead.
func NewReplyWriter(nc *nats.Conn, subject string, attempt int) *ReplyWriter {
	return &ReplyWriter{nc: nc, subject: subject, attempt: []string{strconv.Itoa(attempt)}, attemptN: attempt,
		endWait: DefaultEndWait}
}

// Frame makes the writer send chunks framed, for a gateway that reads them
// (Job.ReplyFramed).
func (w *ReplyWriter) Frame() { w.framed = true }

// Local makes a framed writer hand its reply straight to its gateway when
// that gateway is one of local's. Call it after Frame: the gateway reads a
// chunk's number from its frame, whichever way it came, and a writer of
// header chunks is one an older gateway asked for, never a local one.
func (w *ReplyWriter) Local(local *LocalReplies) {
	if w.framed {
		w.local = local.gateway(w.subject)
	}
}

// keep holds the chunks just sent (w.seq counts them already) until the
// gateway acknowledges them. A local gateway has them already.
func (w *ReplyWriter) keep(chunks ...[]byte) {
	if w.local != nil {
		w.base = w.seq
		return
	}
	w.kept = append(w.kept, chunks...)
}

// send sends one chunk message.
func (w *ReplyWriter) send(msg *nats.Msg) error {
	if w.local != nil {
		w.local.dispatch(msg)
		return nil
	}
	return w.nc.PublishMsg(msg)
}

// ContinueAt makes the writer continue a reply whose first n chunks an
// earlier generation sent (a migrated decode).
func (w *ReplyWriter) ContinueAt(n int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq, w.base, w.start = n, n, n
}

// SetEndWait bounds the wait for the gateway's ack of the end.
func (w *ReplyWriter) SetEndWait(d time.Duration) {
	if d > 0 {
		w.endWait = d
	}
}

// Sent is the number of chunks sent so far, including those of the
// generation this writer continues.
func (w *ReplyWriter) Sent() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seq
}

// Own is the number of chunks this writer sent itself, not counting those
// of the generations it continues.
func (w *ReplyWriter) Own() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seq - w.start
}

// SetStages records the stage runs that the done message reports; the last
// one's duration is measured when Done is sent.
func (w *ReplyWriter) SetStages(stages ...StageRecord) { w.stages = stages }

// Chunk sends one chunk: an SSE event's data, or a whole JSON response.
func (w *ReplyWriter) Chunk(data []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.subject != "" {
		if err := w.send(w.chunkMsg(w.seq, data)); err != nil {
			return fmt.Errorf("send chunk to %s: %w", w.subject, err)
		}
	}
	w.seq++
	w.keep(data)
	return nil
}

// Whole sends a whole response, one that is not streamed: one chunk, or,
// when it is larger than a NATS message may be, consecutive chunks of
// it, each a part of the bytes, which the gateway joins into the one
// response. A reply is not streamed when the request is not: the gateway
// knows to join.
func (w *ReplyWriter) Whole(data []byte) error {
	// As large as a message takes: an answer that fits one goes as one,
	// as a gateway of the build before reads it.
	part := wholePart
	if w.nc != nil {
		if room := int(w.nc.MaxPayload()) - 64<<10; room > 0 { // the frame and headers
			part = room
		}
	}
	for len(data) > part {
		if err := w.Chunk(data[:part:part]); err != nil {
			return err
		}
		data = data[part:]
	}
	return w.Chunk(data)
}

// wholePart is a part of a whole response where no connection says how
// large a message may be.
const wholePart = 1 << 20

// Chunks sends several chunks in one message (HeaderCount), for a gateway
// that reads them (Job.ReplyBatch): one publish, not one per token, when
// the engine has sent several events at once. No chunk may hold a newline.
func (w *ReplyWriter) Chunks(data [][]byte) error {
	if len(data) == 1 {
		return w.Chunk(data[0])
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.subject != "" {
		if err := w.send(w.chunkMsg(w.seq, data...)); err != nil {
			return fmt.Errorf("send %d chunks to %s: %w", len(data), w.subject, err)
		}
	}
	w.seq += len(data)
	w.keep(data...)
	return nil
}

var newline = []byte{'\n'}

// Watch makes the writer's beats tell whether anyone still wants the
// reply: gone is called, once, when the gateway answers a beat that it no
// longer holds the request (its client left, it answered, or a later
// attempt took over), and when a beat gets no answer and wanted (if set)
// says the request no longer wants this work, as its record does once
// the gateway has ended it. The cancel broadcast is sent once, on core
// NATS, and may be lost; a running decode beats every few seconds.
//
// gone gets errSuperseded when the request goes on under a later attempt
// (a redelivery of the job, run elsewhere while this writer was cut off):
// that attempt owns it. Otherwise, errAbandoned: it has ended at its
// gateway.
func (w *ReplyWriter) Watch(gone func(cause error), wanted func(context.Context) bool) {
	w.gone, w.wanted = gone, wanted
}

// isGone calls the gone hook once, with errSuperseded or errAbandoned.
func (w *ReplyWriter) isGone(superseded bool) {
	if w.gone == nil {
		return
	}
	cause := errAbandoned
	if superseded {
		cause = errSuperseded
	}
	w.goneOnce.Do(func() { w.gone(cause) })
}

// Beats sends a heartbeat every interval until stopped, so that the
// gateway knows the decode runs and learns how many chunks it should have.
// The first goes out after one interval, not at once: a decode that
// streams is heard by its chunks, most end before a beat is due, and the
// interval is well within the gateway's stall time-out (see beatEvery).
// An immediate beat cost every request a round trip.
func (w *ReplyWriter) Beats(ctx context.Context, every time.Duration) (stop func()) {
	if w.subject == "" {
		return func() {}
	}
	bctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-bctx.Done():
				return
			case <-t.C:
			}
			w.beat(bctx)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// beat sends one heartbeat and resends what the gateway's ack says it
// lacks. A lost beat or ack is harmless: the next one repeats it.
func (w *ReplyWriter) beat(ctx context.Context) {
	w.mu.Lock()
	upto := w.seq
	msg := w.msg(KindBeat, upto, nil)
	if w.local != nil {
		held := w.local.deliver(msg) // nothing was lost: no ack to wait for
		w.mu.Unlock()
		if held != delivered {
			w.isGone(held == superseded)
		}
		return
	}
	w.mu.Unlock()
	actx, cancel := context.WithTimeout(ctx, ackTimeout)
	defer cancel()
	resp, err := w.nc.RequestMsgWithContext(actx, msg)
	switch {
	case err == nil && resp.Header.Get(HeaderGone) != "":
		w.isGone(resp.Header.Get(HeaderGone) == GoneSuperseded)
	case err == nil:
		w.mu.Lock()
		w.acked(resp, upto)
		w.mu.Unlock()
	case w.wanted != nil && ctx.Err() == nil:
		// No answer: the gateway may be gone, cut off, or its cancel
		// lost with the beat. The record knows whether it ended the
		// request.
		rctx, cancel := context.WithTimeout(ctx, ackTimeout)
		defer cancel()
		if !w.wanted(rctx) {
			w.isGone(false)
		}
	}
}

// acked takes in the gateway's ack of a message sent after upto chunks: the
// chunks it has are dropped, and those it lacks of the first upto sent
// again, in order (later ones may still be on their way). It returns the
// number the gateway has.
func (w *ReplyWriter) acked(resp *nats.Msg, upto int) int {
	n, err := strconv.Atoi(resp.Header.Get(HeaderSeq))
	if err != nil || resp.Header.Get(HeaderKind) != KindAck || n < w.base || n > w.seq {
		return -1 // not an ack of this reply: a stale gateway's, or none
	}
	w.kept = w.kept[n-w.base:]
	w.base = n
	for i := n; i < upto; i++ {
		if err := w.send(w.chunkMsg(i, w.kept[i-n])); err != nil {
			break // the next ack asks again
		}
	}
	return n
}

// Done ends the reply after the chunks sent, once the gateway has them
// all. It fails with ErrReplyUnacked if the gateway does not say so in
// time. A local gateway has them all, in its queue, ahead of the end: the
// end is queued, and Done returns.
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
	return w.end(KindDone, nil, 0, stages)
}

// Moved ends this writer's part of a reply that a later generation
// continues: it returns once the gateway has every chunk sent so far (a
// local gateway, at once: they are in its queue, ahead of this end).
func (w *ReplyWriter) Moved() error {
	if w.subject == "" {
		return nil
	}
	return w.end(KindMoved, nil, 0, nil)
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
	return w.end(KindError, body, e.Status(), nil)
}

// end sends a terminal message until the gateway acks it with every chunk
// (an error needs no chunks), resending what it lacks, for at most the
// writer's end wait.
func (w *ReplyWriter) end(kind string, data []byte, status int, stages []byte) error {
	deadline := time.Now().Add(w.endWait)
	for {
		w.mu.Lock()
		msg := w.msg(kind, w.seq, data)
		w.mu.Unlock()
		if status != 0 {
			msg.Header[HeaderStatus] = []string{strconv.Itoa(status)}
		}
		if stages != nil {
			msg.Header[HeaderStages] = []string{string(stages)}
		}
		if w.local != nil {
			// Every chunk is in the gateway's queue already, and the end
			// goes after them: there is nothing to wait for.
			w.local.dispatch(msg)
			return nil
		}
		upto := w.Sent()
		resp, err := w.nc.RequestMsg(msg, min(ackTimeout, max(time.Until(deadline), time.Millisecond)))
		if err == nil {
			w.mu.Lock()
			n, seq := w.acked(resp, upto), w.seq
			w.mu.Unlock()
			if n == seq || (kind == KindError && n >= 0) {
				return nil
			}
		} else if !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
			// No answer could come: the gateway's subscription is missing
			// (it is gone, or reconnecting), or this connection is down.
			// Ask again shortly.
			time.Sleep(min(250*time.Millisecond, max(time.Until(deadline), 0)))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %s after %v", ErrReplyUnacked, kind, w.endWait)
		}
	}
}

// Kept is what a writer without a subject kept: the chunks, and the stage
// runs.
func (w *ReplyWriter) Kept() ([][]byte, []StageRecord) { return w.kept, w.stages }

// chunkMsg is the message of the chunks from seq on, framed or with
// headers.
func (w *ReplyWriter) chunkMsg(seq int, data ...[]byte) *nats.Msg {
	switch {
	case w.framed:
		return &nats.Msg{Subject: w.subject, Data: w.frame(seq, data...)}
	case len(data) == 1:
		return w.msg(KindChunk, seq, data[0])
	}
	msg := w.msg(KindChunk, seq, bytes.Join(data, newline))
	msg.Header[HeaderCount] = []string{strconv.Itoa(len(data))}
	return msg
}

// frame is the framed payload of chunks from seq on: the frame line, then
// the chunks separated by newlines.
func (w *ReplyWriter) frame(seq int, chunks ...[]byte) []byte {
	size := 32 + len(chunks)
	for _, c := range chunks {
		size += len(c)
	}
	b := make([]byte, 0, size)
	b = strconv.AppendInt(b, int64(w.attemptN), 10)
	b = append(b, ' ')
	b = strconv.AppendInt(b, int64(seq), 10)
	b = append(b, ' ')
	b = strconv.AppendInt(b, int64(len(chunks)), 10)
	for _, c := range chunks {
		b = append(b, '\n')
		b = append(b, c...)
	}
	return b
}

// parseFrame reads a framed chunk message's payload: the inverse of frame,
// with data the chunks as they were joined. ok is false for a payload that
// is not a frame.
func parseFrame(payload []byte) (attempt, seq, count int, data []byte, ok bool) {
	line, data, found := bytes.Cut(payload, newline)
	if !found {
		return 0, 0, 0, nil, false
	}
	var n [3]int
	for i := range n {
		field := line
		if i < 2 {
			var more bool
			if field, line, more = bytes.Cut(line, []byte{' '}); !more {
				return 0, 0, 0, nil, false
			}
		}
		v, err := strconv.Atoi(string(field))
		if err != nil || v < 0 {
			return 0, 0, 0, nil, false
		}
		n[i] = v
	}
	return n[0], n[1], n[2], data, n[2] >= 1
}

func (w *ReplyWriter) msg(kind string, seq int, data []byte) *nats.Msg {
	msg := nats.NewMsg(w.subject)
	msg.Header[HeaderKind] = kindHeader(kind)
	msg.Header[HeaderSeq] = []string{strconv.Itoa(seq)}
	msg.Header[HeaderAttempt] = w.attempt
	msg.Data = data
	return msg
}

// The kind header's values, made once: a header value is only read (a
// Set replaces it, an Add copies it, its capacity being its length).
var (
	kindChunkHeader = []string{KindChunk}
	kindBeatHeader  = []string{KindBeat}
)

// kindHeader is the kind header's value for kind: one made once for the
// kinds every reply sends many of.
func kindHeader(kind string) []string {
	switch kind {
	case KindChunk:
		return kindChunkHeader
	case KindBeat:
		return kindBeatHeader
	}
	return []string{kind}
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
	// ErrReplyGap means chunks went missing and could not be had again:
	// the reply cannot be trusted.
	ErrReplyGap = errors.New("reply chunks lost in transit")
	// ErrReplyRestarted means the decode restarted after output was sent,
	// and not as a continuation: the client cannot be given a second
	// beginning.
	ErrReplyRestarted = errors.New("decode restarted after output was sent")
	// ErrReplyStalled means nothing came for the stall time-out: from a
	// running decode (see [ReplyStream.Heard]), no chunk and no heartbeat,
	// which fails the request; before one, the silence of a queue.
	ErrReplyStalled = errors.New("the decode went silent")
	// ErrInFlight means a request with this id is already in flight here.
	ErrInFlight = errors.New("a request with this id is in flight")
	// ErrReplyOverflow, with ErrReplyGap, means the reply piled up past its
	// bound (or the gateway's budget) because its client read it slower
	// than the engine wrote it.
	ErrReplyOverflow = errors.New("the client reads slower than the engine writes (or the gateway holds PDQ_MAX_INFLIGHT_BYTES)")
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

// Replies is the gateway's end of the reply streams: one wildcard
// subscription on pdq.reply.<gateway>.>, fanned out to the requests that
// wait here.
//
// dispatch and deliver run on the subscription's goroutine and, in pdq
// up, on the goroutines of the local writers (a job's handler, its
// beats), any number at once. Request handlers call Open, Subject and
// ReplyStream.Close, any number at once.
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
	// goroutine that relays a stream; Open and ReplyStream.Close
	// write-lock it.
	mu      sync.RWMutex
	streams map[string]*ReplyStream
}

// SetBudget counts the bytes the reply queues hold in budget, before any
// stream is opened: a reply that does not fit is a gap, and fails its
// request.
func (r *Replies) SetBudget(b Budget) { r.budget = b }

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
	s := &ReplyStream{id: id, owner: r, q: newReplyQueue(r.budget)}
	r.streams[id] = s
	return s, nil
}

func (r *Replies) dispatch(msg *nats.Msg) {
	switch d := r.deliver(msg); {
	case d == delivered:
	case d == superseded:
		ackGone(msg, GoneSuperseded)
	case msg.Header.Get(HeaderKind) == KindBeat:
		// The request has ended here (answered, or given up): a worker
		// that beats is told to stop.
		ackGone(msg, GoneClosed)
	default:
		// One that ends is told it has nothing more to send.
		ack(msg, msg.Header.Get(HeaderSeq))
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
	if msg.Header.Get(HeaderKind) == KindBeat {
		if a, err := strconv.Atoi(msg.Header.Get(HeaderAttempt)); err == nil && int64(a) < s.latest.Load() {
			return superseded
		}
	}
	if !s.q.push(msg) {
		s.overflow.Store(true)
	}
	return delivered
}

// ack answers a worker's beat or end with the number of chunks the
// gateway has.
func ack(msg *nats.Msg, seq string) { answerAck(msg, HeaderSeq, seq) }

// answerAck answers a worker's beat or end with an ack that says one
// thing, in header key.
func answerAck(msg *nats.Msg, key, value string) {
	if msg.Reply == "" {
		return
	}
	a := nats.NewMsg(msg.Reply)
	a.Header[HeaderKind] = []string{KindAck}
	a.Header[key] = []string{value}
	_ = msg.RespondMsg(a) // a lost ack, or gone, is asked for again at the next beat or end
}

// The values of HeaderGone.
const (
	// GoneClosed: the gateway holds no request under the id: it answered
	// it, or gave up on it.
	GoneClosed = "closed"
	// GoneSuperseded: the request goes on under a later attempt.
	GoneSuperseded = "superseded"
)

// ackGone answers a beat the gateway no longer waits for, saying why: the
// worker stops.
func ackGone(msg *nats.Msg, why string) { answerAck(msg, HeaderGone, why) }

// ReplyStream is one request's reply, read in order.
//
// A stream is used by one goroutine at a time: the request's handler,
// which in a batch hands each prompt's stream to a reader goroutine of its
// own and closes it once the readers are done. Start, Whole, OnIdle, Next,
// Heard, Rearm, Generation and Close are that goroutine's; attempt, next,
// moved, base, heard, stall, idle and pending are read and written by it
// only, without a lock. Replies.deliver, on other goroutines, uses only
// q, overflow and latest.
type ReplyStream struct {
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
	// pending are the chunks of a batched message not returned yet.
	pending [][]byte
}

// Start makes the stream follow the reply of the request's generation,
// once its submit has set it: a writer of an earlier generation (the
// decode of an earlier request under this id, still running after its
// client left) is not this request's, and is told it is gone.
func (s *ReplyStream) Start(generation int) {
	s.attempt = ReplyAttempt(generation, 0)
	s.latest.Store(int64(s.attempt))
}

// Close unregisters the request, and gives back the bytes its replies
// held.
func (s *ReplyStream) Close() {
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
func (s *ReplyStream) Whole() {
	s.q.mu.Lock()
	s.q.limit = wholeReplyBytes
	s.q.mu.Unlock()
}

// Generation is the generation of the attempt the stream follows.
func (s *ReplyStream) Generation() int { return s.attempt >> 8 }

// Heard reports whether a decode of the current attempt has been heard
// from.
func (s *ReplyStream) Heard() bool { return s.heard }

// OnIdle sets f to be called whenever Next is about to wait for a reply:
// a relay that writes without flushing flushes there, once per burst of
// replies instead of once per reply. Next fails, wrapping ErrIdle, when f
// does.
func (s *ReplyStream) OnIdle(f func() error) { s.idle = f }

// ErrIdle wraps the error of the OnIdle function.
var ErrIdle = errors.New("writing the replies so far failed")

// Rearm forgets the decode heard so far, for a request that went back to
// prefill: until a decode of it is heard again, silence is expected.
func (s *ReplyStream) Rearm() { s.heard = false }

// Next returns the next reply in order: a chunk, or the terminal done or
// error. Chunks lost in transit are asked for again; Next fails on a
// restart after output, when nothing comes for stall (ErrReplyStalled:
// the caller decides by Heard whether that is a silent decode or a queue),
// or when ctx ends.
func (s *ReplyStream) Next(ctx context.Context, stall time.Duration) (Reply, error) {
	if len(s.pending) > 0 {
		data := s.pending[0]
		s.pending = s.pending[1:]
		return Reply{Kind: KindChunk, Data: data}, nil
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
				return Reply{}, ErrReplyStalled
			case <-ctx.Done():
				return Reply{}, ctx.Err()
			}
		}
		if s.overflow.Load() {
			return Reply{}, fmt.Errorf("%w: %w", ErrReplyGap, ErrReplyOverflow)
		}
		kind, attempt, seq, count, data, err := replyOf(msg)
		if err != nil {
			return Reply{}, err
		}
		switch {
		case attempt < s.attempt && kind == KindBeat:
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
				return Reply{}, ErrReplyRestarted
			}
			s.attempt, s.moved = attempt, false
			s.latest.Store(int64(attempt))
		}
		if !s.heard || kind == KindBeat || (kind == KindChunk && seq <= s.next && s.next < seq+count) {
			owed = true // a sign of life, or progress
		}
		s.heard = true
		switch kind {
		case KindBeat:
			ack(msg, strconv.Itoa(s.next))
			continue
		case KindChunk:
			if seq > s.next || seq+count <= s.next {
				continue // a duplicate, or past a gap the next ack fills
			}
			if count == 1 {
				s.next++
				return Reply{Kind: KindChunk, Data: data}, nil
			}
			parts := bytes.Split(data, newline)
			if len(parts) != count {
				return Reply{}, fmt.Errorf("%w: %d chunks in a message that says %d", ErrReplyGap, len(parts), count)
			}
			parts = parts[s.next-seq:] // what came before is here already
			s.next += len(parts)
			s.pending = parts[1:]
			return Reply{Kind: KindChunk, Data: parts[0]}, nil
		case KindMoved, KindDone:
			ack(msg, strconv.Itoa(s.next))
			if seq > s.next {
				continue // the writer sends what is missing, then ends again
			}
			if seq < s.next {
				return Reply{}, fmt.Errorf("%w: %d chunks sent, %d arrived", ErrReplyGap, seq, s.next)
			}
			if kind == KindMoved {
				s.moved = true
				continue
			}
			done := Reply{Kind: KindDone}
			if raw := msg.Header.Get(HeaderStages); raw != "" {
				_ = json.Unmarshal([]byte(raw), &done.Stages) // informational: a bad one is left out
			}
			return done, nil
		case KindError:
			ack(msg, strconv.Itoa(seq))
			status, _ := strconv.Atoi(msg.Header.Get(HeaderStatus))
			return Reply{Kind: KindError, Data: data, Status: status}, nil
		}
		return Reply{}, fmt.Errorf("%w: unknown reply kind %q", ErrReplyGap, kind)
	}
}

// replyOf reads what a reply message says of itself, from its headers or,
// for a framed chunk (one without a kind header: any header NATS adds on
// the way is no kind), from its frame; data is its payload after the
// frame.
func replyOf(msg *nats.Msg) (kind string, attempt, seq, count int, data []byte, err error) {
	if kind = msg.Header.Get(HeaderKind); kind == "" {
		attempt, seq, count, data, ok := parseFrame(msg.Data)
		if !ok {
			return "", 0, 0, 0, nil, fmt.Errorf("%w: a reply with neither headers nor a frame", ErrReplyGap)
		}
		return KindChunk, attempt, seq, count, data, nil
	}
	attempt, _ = strconv.Atoi(msg.Header.Get(HeaderAttempt))
	if seq, err = strconv.Atoi(msg.Header.Get(HeaderSeq)); err != nil {
		return "", 0, 0, 0, nil, fmt.Errorf("%w: reply without a sequence number", ErrReplyGap)
	}
	count = 1
	if c := msg.Header.Get(HeaderCount); c != "" && kind == KindChunk {
		if count, err = strconv.Atoi(c); err != nil || count < 1 {
			return "", 0, 0, 0, nil, fmt.Errorf("%w: chunk count %q", ErrReplyGap, c)
		}
	}
	return kind, attempt, seq, count, msg.Data, nil
}
