package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/fair"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// The relay writes the workers' replies to the client: the JSON body, or
// the SSE events, flushed once per burst. One loop serves a single request
// and a batch of prompts (batch.go) alike: each job is a leg, and a hook
// rewrites what the legs send into the client's answer, the way
// httputil.ReverseProxy takes ModifyResponse (a batch's: openai.BatchMerge). A single request is one leg
// whose answer passes as the worker sent it, its ids put back; a batch's
// legs are merged into one answer. An error that comes before any output
// keeps its HTTP status; after that it can only be an in-stream error.
// Whatever ends the relay early, the workers are told to stop.

// leg is one job of a relay: a single request's, or a prompt's of a batch.
type leg struct {
	job     *dispatcher.Job
	claim   *submit.Claim
	replies *reply.Stream
	log     *slog.Logger
	// settled is set once the job's record holds its end: a worker's
	// error, or the gateway's stop. A job whose done arrived is not
	// settled until its answer went out.
	settled bool
	chunks  int // chunks received
	done    reply.Reply
	// output is the generation of the last chunk read (0: none yet), by
	// the leg's reader only (readLegs): a decode heard from may wait in
	// the queue again only before its generation's first output.
	output int
}

// merge rewrites the legs' replies into the client's answer.
type merge interface {
	// Chunk rewrites a stream chunk of leg i; held keeps it back, for
	// Tail.
	Chunk(i int, data []byte) (out []byte, held bool, err error)
	// Whole joins the legs' whole answers (not streamed) into one body.
	Whole(parts [][]byte) ([]byte, error)
	// Tail is a stream's last event before [DONE], or nil.
	Tail() []byte
}

// ownIDs is a single request's merge: the answer as the worker sent it,
// with the client's ids put back (responseIDs).
type ownIDs struct{ ids *responseIDs }

func (m ownIDs) Chunk(_ int, data []byte) ([]byte, bool, error) { return m.ids.apply(data), false, nil }
func (m ownIDs) Whole(parts [][]byte) ([]byte, error)           { return m.ids.apply(parts[0]), nil }
func (ownIDs) Tail() []byte                                     { return nil }

// legReply is a reply of leg i, or the error that ended its stream (i is
// -1 when the relay itself ended).
type legReply struct {
	i   int
	r   reply.Reply
	err error
}

// errClientGone ends a relay whose client stopped taking its answer.
var errClientGone = errors.New("client went away")

// relay writes the replies of legs to the client, merged by m, and records
// how the request ended: its legs' records, and parent's for a batch (nil
// for a single request). The request logs its end once.
func (h *handlers) relay(c echo.Context, legs []*leg, m merge, parent *batchRecord, stream bool, log *slog.Logger) error {
	t := trackOf(c)
	ctx, cancel := h.relayContext(c, legs[0].job.Deadline)
	var sse *openai.SSEWriter
	if stream {
		sse = openai.NewSSEWriter(c.Response())
	}
	// The request's turn in the fair queue ends once its prefill ends or a
	// decode of it is heard from (of each prompt, for a batch): it no
	// longer waits for the pool's engines (see fair.Queue).
	if turn, ok := c.Get(turnKey).(*fair.Turn); ok && turn.Bypassed() {
		// Gone decode-only past a full pool (see submit), its turn ends
		// once its decode engine has computed its prompt, at its first
		// token: until then the engine's steps carry the prompt, which
		// slows every decode there, and the bypass lets in one a
		// decode engine at a time.
		t.onFirst = turn.Started
	} else if ok {
		var waiting atomic.Int64
		waiting.Store(int64(len(legs)))
		for _, l := range legs {
			var once sync.Once
			l.replies.OnStarted(func() {
				once.Do(func() {
					if waiting.Add(-1) == 0 {
						turn.Started()
					}
				})
			})
		}
	}
	next, wait := h.readLegs(ctx, legs, sse)
	defer wait()
	defer cancel() // before the wait: it ends the readers
	// stop ends every leg not settled yet, the ones that finished
	// included: their answers never went out.
	stop := func(state dispatcher.State, status int, why string) {
		parent.end(state, status, why)
		for _, l := range legs {
			if !l.settled {
				h.stop(l.job, l.log, state, status, why)
				l.settled = true
			}
		}
	}
	// end is stop for a request the gateway gives up on, logged once.
	end := func(state dispatcher.State, status int, why string) {
		stop(state, status, why)
		if len(legs) > 1 {
			log.Info("request stopped: "+why, "state", string(state), "prompts", len(legs))
		} else {
			log.Info("request stopped: "+why, "state", string(state))
		}
	}
	// fail ends the request with an error: with its status before any
	// output, in the stream after it.
	fail := func(apiErr *openai.Error) error {
		end(dispatcher.StateFailed, apiErr.Status(), apiErr.Message)
		if sse != nil && sse.Started() {
			t.failed = true
			if err := sse.Error(apiErr); err != nil {
				log.Debug("could not write the in-stream error", logging.Err(err))
			}
			return nil
		}
		return writeError(c, apiErr)
	}
	whole := make([][]byte, len(legs)) // the answers not streamed
	var joined int64                   // the bytes joined to them, taken from the budget
	defer func() { h.budget.release(joined) }()
	for left := len(legs); left > 0; {
		lr := next()
		if errors.Is(lr.err, errClientGone) {
			end(dispatcher.StateCancelled, 499, errClientGone.Error())
			return nil
		}
		if lr.err != nil {
			// replyFailed ends (and logs) the request as one job would;
			// the other legs end the same way.
			first := max(lr.i, 0)
			legs[first].settled = true
			err := h.replyFailed(c, ctx, sse, legs[first].job, lr.err, log)
			switch {
			case c.Request().Context().Err() != nil:
				stop(dispatcher.StateCancelled, 499, errClientGone.Error())
			case errors.Is(context.Cause(ctx), errDeadline):
				stop(dispatcher.StateExpired, http.StatusGatewayTimeout, errDeadline.Error())
			case errors.Is(context.Cause(ctx), errShutdown):
				stop(dispatcher.StateCancelled, http.StatusServiceUnavailable, errShutdown.Error())
			default:
				parent.end(dispatcher.StateFailed, http.StatusBadGateway, fmt.Sprintf("prompt %d failed: %v", first, lr.err))
				stop(dispatcher.StateCancelled, http.StatusBadGateway, "another prompt of its batch failed")
			}
			return err
		}
		l := legs[lr.i]
		switch lr.r.Kind {
		case dispatcher.KindError:
			l.settled = true
			h.failed(l.job, lr.r, l.log)
			parent.end(dispatcher.StateFailed, lr.r.Status, fmt.Sprintf("prompt %d failed", lr.i))
			stop(dispatcher.StateCancelled, lr.r.Status, "another prompt of its batch failed")
			if sse != nil && sse.Started() {
				t.failed = true
				if err := sse.Data(lr.r.Data); err == nil {
					sse.Done()
				}
				return nil
			}
			return h.writeWorkerError(c, lr.r)
		case dispatcher.KindDone:
			left--
			if l.chunks == 0 {
				return fail(openai.NewError(http.StatusBadGateway, "the engine sent an empty reply"))
			}
			l.done = lr.r
		case dispatcher.KindChunk:
			l.chunks++
			if !stream {
				// The answer, in parts if it was larger than a message: what
				// the gateway joins counts in its budget, as the parts did.
				if whole[lr.i] == nil {
					whole[lr.i] = lr.r.Data
					continue
				}
				if !h.budget.take(int64(len(lr.r.Data))) {
					apiErr := h.answerOverBudget(c) // no output yet: nothing is streamed
					end(dispatcher.StateFailed, apiErr.Status(), "the gateway holds PDQ_MAX_INFLIGHT_BYTES")
					return writeError(c, apiErr)
				}
				joined += int64(len(lr.r.Data))
				whole[lr.i] = append(slices.Clip(whole[lr.i]), lr.r.Data...)
				continue
			}
			out, held, err := m.Chunk(lr.i, lr.r.Data)
			if err != nil {
				return fail(openai.NewError(http.StatusBadGateway, "%v", err))
			}
			if held {
				continue
			}
			t.wrote(h.cfg.Counters)
			if err := sse.Write(out); err != nil {
				end(dispatcher.StateCancelled, 499, errClientGone.Error())
				return nil
			}
		}
	}
	if !stream {
		out, err := m.Whole(whole)
		if err != nil {
			return fail(openai.NewError(http.StatusBadGateway, "could not merge the answers of the batch: %v", err))
		}
		t.wrote(h.cfg.Counters)
		if err := c.Blob(http.StatusOK, echo.MIMEApplicationJSON, out); err != nil {
			end(dispatcher.StateCancelled, 499, errClientGone.Error())
			return nil
		}
	} else {
		if tail := m.Tail(); tail != nil {
			if err := sse.Data(tail); err != nil {
				end(dispatcher.StateCancelled, 499, errClientGone.Error())
				return nil
			}
		}
		if err := sse.Done(); err != nil {
			log.Debug("client went away before [DONE]", logging.Err(err))
		}
	}
	for _, l := range legs {
		h.delivered(l.job, l.claim, l.done, l.log)
	}
	t.whole = true
	return nil
}

// readLegs returns next, which returns the next reply of any leg, and
// wait, which waits for the readers to end once ctx has. The events
// written so far are flushed before next waits: one flush per burst, never
// an event held back. A single leg is read on the caller's goroutine, its
// flush run by its stream; a batch's legs each by a goroutine of their own.
func (h *handlers) readLegs(ctx context.Context, legs []*leg, sse *openai.SSEWriter) (next func() legReply, wait func()) {
	if len(legs) == 1 {
		l := legs[0]
		if sse != nil {
			l.replies.OnIdle(sse.Flush)
		}
		return func() legReply {
			r, err := h.next(ctx, l)
			if errors.Is(err, reply.ErrIdle) {
				err = errClientGone
			}
			return legReply{r: r, err: err}
		}, func() {}
	}
	in := make(chan legReply)
	var wg sync.WaitGroup
	for i, l := range legs {
		wg.Go(func() {
			for {
				r, err := h.next(ctx, l)
				select {
				case in <- legReply{i: i, r: r, err: err}:
				case <-ctx.Done():
					return
				}
				if err != nil || r.Kind != dispatcher.KindChunk {
					return
				}
			}
		})
	}
	return func() legReply {
		select {
		case lr := <-in:
			return lr
		default:
		}
		if sse != nil && sse.Flush() != nil {
			return legReply{i: -1, err: errClientGone}
		}
		select {
		case lr := <-in:
			return lr
		case <-ctx.Done():
			return legReply{i: -1, err: ctx.Err()}
		}
	}, wg.Wait
}

// errDeadline is the cause of a relay stopped by the request's deadline.
var errDeadline = errors.New("the request's deadline passed")

// errShutdown ends the relays still running when the gateway's shutdown
// grace period runs out.
var errShutdown = errors.New("the gateway shut down before the answer was complete")

// relayContext is a relay's context: it ends with the client's request,
// at the request's deadline (cause errDeadline), or when the gateway's
// grace period runs out (cause errShutdown).
func (h *handlers) relayContext(c echo.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	ctx, cancelDeadline := context.WithDeadlineCause(c.Request().Context(), deadline, errDeadline)
	ctx, cancel := context.WithCancelCause(ctx)
	remove := h.relays.add(cancel)
	return ctx, func() {
		remove()
		cancel(nil)
		cancelDeadline()
	}
}

// relays holds the cancel functions of the relays running, so that the
// end of the grace period can stop them all with errShutdown.
//
// Request handlers call add, the removal it returns, and ended, any number
// at once; the gateway's Run calls end once the grace period is over.
// end calls the cancels after it has let mu go.
type relays struct {
	// mu guards the fields below.
	mu      sync.Mutex
	endedAt time.Time // zero while the grace period runs
	next    uint64
	cancels map[uint64]context.CancelCauseFunc
}

func newRelays() *relays { return &relays{cancels: make(map[uint64]context.CancelCauseFunc)} }

// add registers a relay's cancel, and returns its removal. A relay that
// starts after the end is stopped at once.
func (r *relays) add(cancel context.CancelCauseFunc) (remove func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.endedAt.IsZero() {
		cancel(errShutdown)
		return func() {}
	}
	r.next++
	id := r.next
	r.cancels[id] = cancel
	return func() {
		r.mu.Lock()
		delete(r.cancels, id)
		r.mu.Unlock()
	}
}

// end stops every relay running, and any that starts later.
func (r *relays) end() {
	r.mu.Lock()
	r.endedAt = time.Now()
	cancels := r.cancels
	r.cancels = make(map[uint64]context.CancelCauseFunc)
	r.mu.Unlock()
	for _, cancel := range cancels {
		cancel(errShutdown)
	}
}

// ended reports whether the grace period is over, and since when.
func (r *relays) ended() (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.endedAt, !r.endedAt.IsZero()
}
