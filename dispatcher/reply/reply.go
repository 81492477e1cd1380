package reply

// The reply protocol carries a worker's answer to the gateway that holds
// its client: over core NATS, on the request's reply subject
// pdq.reply.<gateway>.<id> (Job.ReplyTo), or in memory when the gateway
// runs in the same process (LocalReplies, in pdq up). The writer is
// reply_writer.go, the reader reply_stream.go, and what lies between them
// (the reader's bounded queue, the in-process hand-over) reply_queue.go.
//
// Worker to gateway (HeaderKind):
//   - chunk: part of the answer, numbered from 0 (HeaderSeq); to a gateway
//     that takes them (Job.ReplyBatch) one message may carry several
//     (HeaderCount), and to one that reads frames (Job.ReplyFramed) the
//     numbers go in a frame line instead of headers (see frame and
//     parseFrame).
//   - beat: a running decode's sign of life, with the number of chunks
//     sent; every fifth of the stall time-out, between 100 ms and 2 s apart
//     (beatEvery): at least five within it.
//   - done: the end, with the number of chunks sent and the stage runs
//     (HeaderStages).
//   - error: the end, with the client's error envelope and its HTTP
//     status (HeaderStatus).
//   - moved: the end of a decode whose answer a later generation goes on
//     with from this chunk (a migration).
//
// Gateway to worker, as the NATS reply to a beat or an end:
//   - ack: the number of chunks the gateway has, in order (HeaderSeq). The
//     worker resends what follows it: core NATS may lose messages, so
//     nothing is taken as delivered until acked.
//   - ack with HeaderGone, to a beat: the gateway no longer holds the
//     request (GoneClosed: answered or given up; GoneSuperseded: a later
//     attempt runs it). The worker stops. An end the gateway no longer
//     waits for is acked with its own count, and the writer finishes.
//
// Every message carries its attempt (ReplyAttempt: the generation, then
// the delivery). The writer (Writer) sends chunks and keeps them until
// acked; beats run beside the sends while a decode runs; one end (done,
// moved) is sent again until the gateway acks it with every chunk (an
// error, until it is acked at all), for at most the writer's end wait. The reader (Stream) follows the
// latest attempt: an earlier attempt's messages are acked away (its beats
// told Gone); a later attempt after a moved goes on from the chunk where
// it moved, after chunks were sent it is ErrRestarted (the client
// cannot be given a second beginning), and before that it starts over. A
// chunk past a gap is dropped, and the ack of the next beat or end asks
// for it again; silence past the stall time-out is ErrStalled (an end
// that reports chunks that never came is waited on until then).
// ErrGap is a reply that cannot be trusted: one piled up past its
// bound, a malformed or miscounted message, an end that reports fewer
// chunks than came.

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
)

// Reply is one message of a reply stream, as the gateway reads it.
type Reply struct {
	Kind string
	// Data is a chunk's payload, or an error's envelope.
	Data []byte
	// Status is an error's HTTP status.
	Status int
	// Stages are the stage runs a done message reports.
	Stages []dispatcher.StageRecord
}

// Errors of [Stream.Next].
var (
	// ErrGap means chunks went missing and could not be had again:
	// the reply cannot be trusted.
	ErrGap = errors.New("reply chunks lost in transit")
	// ErrRestarted means the decode restarted after output was sent,
	// and not as a continuation: the client cannot be given a second
	// beginning.
	ErrRestarted = errors.New("decode restarted after output was sent")
	// ErrStalled means nothing came for the stall time-out: from a
	// running decode (see [Stream.Heard]), no chunk and no heartbeat,
	// which fails the request; before one, the silence of a queue.
	ErrStalled = errors.New("the decode went silent")
	// ErrInFlight means a request with this id is already in flight here.
	ErrInFlight = errors.New("a request with this id is in flight")
	// ErrOverflow, with ErrGap, means the reply piled up past its
	// bound (or the gateway's budget) because its client read it slower
	// than the engine wrote it.
	ErrOverflow = errors.New("the client reads slower than the engine writes (or the gateway holds PDQ_MAX_INFLIGHT_BYTES)")
)

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

// ack answers a worker's beat or end with the number of chunks the
// gateway has.
func ack(msg *nats.Msg, seq string) { answerAck(msg, dispatcher.HeaderSeq, seq) }

// answerAck answers a worker's beat or end with an ack that says one
// thing, in header key.
func answerAck(msg *nats.Msg, key, value string) {
	if msg.Reply == "" {
		return
	}
	a := nats.NewMsg(msg.Reply)
	a.Header[dispatcher.HeaderKind] = []string{dispatcher.KindAck}
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
func ackGone(msg *nats.Msg, why string) { answerAck(msg, dispatcher.HeaderGone, why) }

// replyOf reads what a reply message says of itself, from its headers or,
// for a framed chunk (one without a kind header: any header NATS adds on
// the way is no kind), from its frame; data is its payload after the
// frame.
func replyOf(msg *nats.Msg) (kind string, attempt, seq, count int, data []byte, err error) {
	if kind = msg.Header.Get(dispatcher.HeaderKind); kind == "" {
		attempt, seq, count, data, ok := parseFrame(msg.Data)
		if !ok {
			return "", 0, 0, 0, nil, fmt.Errorf("%w: a reply with neither headers nor a frame", ErrGap)
		}
		return dispatcher.KindChunk, attempt, seq, count, data, nil
	}
	attempt, _ = strconv.Atoi(msg.Header.Get(dispatcher.HeaderAttempt))
	if seq, err = strconv.Atoi(msg.Header.Get(dispatcher.HeaderSeq)); err != nil {
		return "", 0, 0, 0, nil, fmt.Errorf("%w: reply without a sequence number", ErrGap)
	}
	count = 1
	if c := msg.Header.Get(dispatcher.HeaderCount); c != "" && kind == dispatcher.KindChunk {
		if count, err = strconv.Atoi(c); err != nil || count < 1 {
			return "", 0, 0, 0, nil, fmt.Errorf("%w: chunk count %q", ErrGap, c)
		}
	}
	return kind, attempt, seq, count, msg.Data, nil
}
