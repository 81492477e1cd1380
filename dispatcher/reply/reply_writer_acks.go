package reply

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Errors of a [Writer]'s end.
var (
	// ErrUnacked means the gateway did not acknowledge the end within
	// the writer's wait: it is gone, or cut off from NATS. Its own stall
	// timer answers the client.
	ErrUnacked = errors.New("the gateway did not acknowledge the reply")
)

// Watch makes the writer's beats tell whether anyone still wants the
// reply: gone is called, once, when the gateway answers a beat that it no
// longer holds the request (its client left, it answered, or a later
// attempt took over), and when a beat gets no answer and wanted (if set)
// says the request no longer wants this work, as its record does once
// the gateway has ended it. The cancel broadcast is sent once, on core
// NATS, and may be lost; a running decode beats every few seconds.
//
// gone gets ErrSuperseded when the request goes on under a later attempt
// (a redelivery of the job, run elsewhere while this writer was cut off):
// that attempt owns it. Otherwise, ErrAbandoned: it has ended at its
// gateway.
func (w *Writer) Watch(gone func(cause error), wanted func(context.Context) bool) {
	w.gone, w.wanted = gone, wanted
}

// isGone calls the gone hook once, with ErrSuperseded or ErrAbandoned.
func (w *Writer) isGone(superseded bool) {
	if w.gone == nil {
		return
	}
	cause := ErrAbandoned
	if superseded {
		cause = ErrSuperseded
	}
	w.goneOnce.Do(func() { w.gone(cause) })
}

// Beats sends a heartbeat every interval until stopped, so that the
// gateway knows the decode runs and learns how many chunks it should have.
// The first goes out after one interval, not at once (unless BeatAtOnce):
// a decode that streams is heard by its chunks, most end before a beat is
// due, and the interval is well within the gateway's stall time-out (see
// beatEvery). An immediate beat cost every request a round trip.
func (w *Writer) Beats(ctx context.Context, every time.Duration) (stop func()) {
	if w.subject == "" {
		return func() {}
	}
	bctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		if w.beatAtOnce {
			w.beat(bctx)
		}
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
func (w *Writer) beat(ctx context.Context) {
	w.mu.Lock()
	upto := w.seq
	msg := w.msg(dispatcher.KindBeat, upto, nil)
	if w.local != nil {
		held := w.local.deliver(msg) // nothing was lost: no ack to wait for
		w.mu.Unlock()
		if held != delivered {
			w.isGone(held == superseded)
		}
		return
	}
	w.mu.Unlock()
	actx, cancel := context.WithTimeout(ctx, AckTimeout)
	defer cancel()
	resp, err := w.nc.RequestMsgWithContext(actx, msg)
	switch {
	case err == nil && resp.Header.Get(dispatcher.HeaderGone) != "":
		w.isGone(resp.Header.Get(dispatcher.HeaderGone) == GoneSuperseded)
	case err == nil:
		w.mu.Lock()
		w.acked(resp, upto)
		w.mu.Unlock()
	case w.wanted != nil && ctx.Err() == nil:
		// No answer: the gateway may be gone, cut off, or its cancel
		// lost with the beat. The record knows whether it ended the
		// request.
		rctx, cancel := context.WithTimeout(ctx, AckTimeout)
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
func (w *Writer) acked(resp *nats.Msg, upto int) int {
	n, err := strconv.Atoi(resp.Header.Get(dispatcher.HeaderSeq))
	if err != nil || resp.Header.Get(dispatcher.HeaderKind) != dispatcher.KindAck || n < w.base || n > w.seq {
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
// all. It fails with ErrUnacked if the gateway does not say so in
// time. A local gateway has them all, in its queue, ahead of the end: the
// end is queued, and Done returns.
func (w *Writer) Done() error {
	var stages []byte
	if n := len(w.stages); n > 0 {
		last := &w.stages[n-1]
		last.Ms = float64(time.Since(last.Started).Microseconds()) / 1000
		stages, _ = json.Marshal(w.stages) // plain fields: it always encodes
	}
	if w.subject == "" {
		return nil
	}
	return w.end(dispatcher.KindDone, nil, 0, stages)
}

// Moved ends this writer's part of a reply that a later generation
// continues: it returns once the gateway has every chunk sent so far (a
// local gateway, at once: they are in its queue, ahead of this end).
func (w *Writer) Moved() error {
	if w.subject == "" {
		return nil
	}
	return w.end(dispatcher.KindMoved, nil, 0, nil)
}

// Error ends the reply with an error to pass to the client.
func (w *Writer) Error(e *openai.Error) error {
	if w.subject == "" {
		// No client (a replay): the request's record says how it failed,
		// which settle writes from the handler's error.
		return nil
	}
	body, err := json.Marshal(openai.ErrorResponse{Error: e})
	if err != nil {
		return fmt.Errorf("encode error reply: %w", err)
	}
	return w.end(dispatcher.KindError, body, e.Status(), nil)
}

// end sends a terminal message until the gateway acks it with every chunk
// (an error needs no chunks), resending what it lacks, for at most the
// writer's end wait.
func (w *Writer) end(kind string, data []byte, status int, stages []byte) error {
	deadline := time.Now().Add(w.endWait)
	for {
		w.mu.Lock()
		msg := w.msg(kind, w.seq, data)
		w.mu.Unlock()
		if status != 0 {
			msg.Header[dispatcher.HeaderStatus] = []string{strconv.Itoa(status)}
		}
		if stages != nil {
			msg.Header[dispatcher.HeaderStages] = []string{string(stages)}
		}
		if w.local != nil {
			// Every chunk is in the gateway's queue already, and the end
			// goes after them: there is nothing to wait for.
			w.local.dispatch(msg)
			return nil
		}
		upto := w.Sent()
		resp, err := w.nc.RequestMsg(msg, min(AckTimeout, max(time.Until(deadline), time.Millisecond)))
		if err == nil {
			w.mu.Lock()
			n, seq := w.acked(resp, upto), w.seq
			w.mu.Unlock()
			if n == seq || (kind == dispatcher.KindError && n >= 0) {
				return nil
			}
		} else if !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
			// No answer could come: the gateway's subscription is missing
			// (it is gone, or reconnecting), or this connection is down.
			// Ask again shortly.
			time.Sleep(min(250*time.Millisecond, max(time.Until(deadline), 0)))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %s after %v", ErrUnacked, kind, w.endWait)
		}
	}
}

var (
	// ErrAbandoned stops a job whose gateway no longer holds its request,
	// or whose record says it ended: its cancel broadcast was lost.
	ErrAbandoned = errors.New("the gateway no longer holds the request")
	// ErrSuperseded stops a job whose request the gateway follows under a
	// later attempt: a redelivery of it, run while this worker was cut
	// off from NATS past the ack wait.
	ErrSuperseded = errors.New("a later attempt of the request runs")
)
