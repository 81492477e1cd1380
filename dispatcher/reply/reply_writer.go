package reply

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
)

// Writer sends a request's reply to the gateway over core NATS: chunks
// numbered from 0, then one terminal message, done, error or moved (see
// the protocol in reply.go). Core NATS may
// lose messages (a slow consumer, a server restart), so nothing is taken
// as delivered until the gateway says so: the writer keeps the chunks, a
// running decode beats (see [Writer.Beats]), and the gateway answers
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
type Writer struct {
	// Set before the writer is shared (by NewWriter, and Frame,
	// Local, SetEndWait, BeatAtOnce and Watch before Beats starts), read
	// without a lock.
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
	// beatAtOnce sends the first beat as Beats starts (BeatAtOnce).
	beatAtOnce bool

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
	// message, for the gateway's request record.
	stages []dispatcher.StageRecord

	// gone is called once when the gateway says it no longer holds the
	// request; wanted, when a beat gets no answer, says whether the
	// request still wants this writer's work (see Watch). Set by Watch
	// before Beats starts; gone is called from the beats' goroutine.
	gone     func(cause error)
	goneOnce sync.Once
	wanted   func(context.Context) bool
}

// DefaultEndWait is how long a writer waits for the gateway to acknowledge
// the end of a reply.
const DefaultEndWait = 10 * time.Second

// AckTimeout is the wait for one ack; the end is sent again after it.
const AckTimeout = time.Second

// NewWriter writes to subject as the given attempt (see
// [ReplyAttempt]); an empty subject keeps the reply instead.
func NewWriter(nc *nats.Conn, subject string, attempt int) *Writer {
	return &Writer{nc: nc, subject: subject, attempt: []string{strconv.Itoa(attempt)}, attemptN: attempt,
		endWait: DefaultEndWait}
}

// Frame makes the writer send chunks framed, for a gateway that reads them
// (Job.ReplyFramed).
func (w *Writer) Frame() { w.framed = true }

// Local makes a framed writer hand its reply straight to its gateway when
// that gateway is one of local's. Call it after Frame: the gateway reads a
// chunk's number from its frame, whichever way it came, and a writer of
// header chunks is one an older gateway asked for, never a local one.
func (w *Writer) Local(local *LocalReplies) {
	if w.framed {
		w.local = local.gateway(w.subject)
	}
}

// keep holds the chunks just sent (w.seq counts them already) until the
// gateway acknowledges them. A local gateway has them already.
func (w *Writer) keep(chunks ...[]byte) {
	if w.local != nil {
		w.base = w.seq
		return
	}
	w.kept = append(w.kept, chunks...)
}

// send sends one chunk message.
func (w *Writer) send(msg *nats.Msg) error {
	if w.local != nil {
		w.local.dispatch(msg)
		return nil
	}
	return w.nc.PublishMsg(msg)
}

// ContinueAt makes the writer continue a reply whose first n chunks an
// earlier generation sent (a migrated decode).
func (w *Writer) ContinueAt(n int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq, w.base, w.start = n, n, n
}

// BeatAtOnce makes Beats send its first beat at once, for a gateway that
// wants to hear as a decode starts, before its first chunk (Job.ReplyStart:
// its fair queue lets the next request in then, see Stream.OnStarted).
func (w *Writer) BeatAtOnce() { w.beatAtOnce = true }

// Prefilled tells the gateway that the request's prefill ended on the
// engine keyed engine (see dispatcher.KindPrefilled): its fair queue lets
// the next request in then, not a hand-off later, when the decode starts,
// and its placer learns where a prompt it sent to no engine in particular
// went. Nothing answers it; one lost costs only that hand-off, the
// decode's start doing the same, and that prompt's place. Sent early
// (before the engine answers, see workers' prefillLead) by a prefill that
// then fails, it names an engine that may not hold the prompt; the retry
// names the engine that does, and the index holds both: rare, and it
// costs a later turn at most a cache miss.
func (w *Writer) Prefilled(engine string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.send(w.msg(dispatcher.KindPrefilled, 0, []byte(engine)))
}

// SetEndWait bounds the wait for the gateway's ack of the end.
func (w *Writer) SetEndWait(d time.Duration) {
	if d > 0 {
		w.endWait = d
	}
}

// Sent is the number of chunks sent so far, including those of the
// generation this writer continues.
func (w *Writer) Sent() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seq
}

// Own is the number of chunks this writer sent itself, not counting those
// of the generations it continues.
func (w *Writer) Own() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seq - w.start
}

// SetStages records the stage runs that the done message reports; the last
// one's duration is measured when Done is sent.
func (w *Writer) SetStages(stages ...dispatcher.StageRecord) { w.stages = stages }

// Chunk sends one chunk: an SSE event's data, or a whole JSON response.
func (w *Writer) Chunk(data []byte) error {
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
func (w *Writer) Whole(data []byte) error {
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
func (w *Writer) Chunks(data [][]byte) error {
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

// Kept is what a writer without a subject kept: the chunks, and the stage
// runs.
func (w *Writer) Kept() ([][]byte, []dispatcher.StageRecord) { return w.kept, w.stages }

// chunkMsg is the message of the chunks from seq on, framed or with
// headers.
func (w *Writer) chunkMsg(seq int, data ...[]byte) *nats.Msg {
	switch {
	case w.framed:
		return &nats.Msg{Subject: w.subject, Data: w.frame(seq, data...)}
	case len(data) == 1:
		return w.msg(dispatcher.KindChunk, seq, data[0])
	}
	msg := w.msg(dispatcher.KindChunk, seq, bytes.Join(data, newline))
	msg.Header[dispatcher.HeaderCount] = []string{strconv.Itoa(len(data))}
	return msg
}

// frame is the framed payload of chunks from seq on: the frame line, then
// the chunks separated by newlines.
func (w *Writer) frame(seq int, chunks ...[]byte) []byte {
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

func (w *Writer) msg(kind string, seq int, data []byte) *nats.Msg {
	msg := nats.NewMsg(w.subject)
	msg.Header[dispatcher.HeaderKind] = kindHeader(kind)
	msg.Header[dispatcher.HeaderSeq] = []string{strconv.Itoa(seq)}
	msg.Header[dispatcher.HeaderAttempt] = w.attempt
	msg.Data = data
	return msg
}

// The kind header's values, made once: a header value is only read (a
// Set replaces it, an Add copies it, its capacity being its length).
var (
	kindChunkHeader = []string{dispatcher.KindChunk}
	kindBeatHeader  = []string{dispatcher.KindBeat}
)

// kindHeader is the kind header's value for kind: one made once for the
// kinds every reply sends many of.
func kindHeader(kind string) []string {
	switch kind {
	case dispatcher.KindChunk:
		return kindChunkHeader
	case dispatcher.KindBeat:
		return kindBeatHeader
	}
	return []string{kind}
}
