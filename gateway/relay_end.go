package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// How a relayed request ends: the replies read with the record behind
// them, the end recorded, the workers stopped, the client answered.

// next reads leg l's next reply. A decode that goes silent for the stall
// time-out fails the request, unless the request went back to prefill as a
// new generation (silent until its decode starts), or the decode heard
// from, before any output of its generation, no longer runs: it gave the
// job back to the queue (handed back, or retried) or its worker is gone,
// and the job waits for its next decode as a queued one does. Each
// silence, heard decode or not, looks at the request's record, so that an
// end whose message was lost (failed, cancelled, expired) still reaches
// the client.
func (h *handlers) next(ctx context.Context, l *leg) (reply.Reply, error) {
	replies, job := l.replies, l.job
	for {
		r, err := replies.Next(ctx, h.cfg.StallTimeout)
		if err == nil && r.Kind == dispatcher.KindChunk {
			l.output = replies.Generation()
		}
		if !errors.Is(err, reply.ErrStalled) {
			return r, err
		}
		if !h.nc.IsConnected() {
			// No reply can come while NATS is out of reach, nor the record
			// be read: the client gets its answer now, not at the deadline.
			return r, errNATSDown
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		rec, _, gerr := h.records.Get(rctx, job.ID)
		cancel()
		switch {
		case gerr == nil && rec.Gateway == h.id && rec.State.Ended() && rec.State != dispatcher.StateDone:
			// Failed, cancelled or expired by a worker (one that took this
			// gateway for gone, say), whose error message was lost.
			e := openai.NewError(http.StatusBadGateway, "the request ended: %s", rec.State)
			switch {
			case rec.Error != nil && rec.Error.Status == 499:
				// A worker took this gateway for gone (it was cut off from
				// NATS): the request may be retried, as the worker said.
				e = openai.NewError(http.StatusServiceUnavailable, "pdq lost touch with this request and stopped it; retry it")
			case rec.Error != nil && rec.Error.Status >= 400 && rec.Error.Status <= 599:
				e = openai.NewError(rec.Error.Status, "%s", rec.Error.Message)
			}
			data, _ := json.Marshal(openai.ErrorResponse{Error: e})
			return reply.Reply{Kind: dispatcher.KindError, Data: data, Status: e.Status()}, nil
		case !replies.Heard():
			continue // queued or prefilling: only the deadline bounds that
		case gerr != nil || rec.Gateway != h.id || rec.State.Ended():
			return r, err
		case rec.Generation > replies.Generation():
			// Sent back to prefill: silent until its next decode starts.
		case l.output == replies.Generation() || h.decodeBeating(ctx, job.ID, replies.Generation()):
			// A decode that sent output cannot be given back; one that
			// still beats, unheard for the stall time-out, has lost its
			// beats: either is silent where it should not be.
			return r, err
		}
		replies.Rearm()
	}
}

// decodeBeating asks the decode workers whether a decode of the request's
// generation runs, and has beaten for the whole stall time-out (one that
// began since is the next decode, whose first beat is on its way). The
// decode heard from beat from its start (at once, with Job.ReplyStart)
// until its handler returned; when none answers, it returned without an
// answer, and the job waits in the queue or for its redelivery.
func (h *handlers) decodeBeating(ctx context.Context, id string, generation int) bool {
	return dispatcher.DecodeBeating(ctx, h.nc, id, generation, h.cfg.StallTimeout, beatingWait)
}

// beatingWait bounds the wait for a decode worker's answer to whether it
// runs a decode: a round trip. Only a worker that runs it answers, so a
// decode that waits in the queue costs the whole wait, once.
const beatingWait = 500 * time.Millisecond

// errNATSDown fails a request whose reply went silent while NATS was out
// of reach: a 503, for the client to retry.
var errNATSDown = errors.New("pdq lost its connection to NATS during the request; retry it")

// delivered records a request whose answer went out whole, starting from
// the record its claim wrote.
func (h *handlers) delivered(job *dispatcher.Job, claim *submit.Claim, done reply.Reply, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	change := func(r *dispatcher.Record) error {
		if r.Gateway != h.id {
			return dispatcher.ErrNoChange
		}
		r.State, r.Error, r.Stages = dispatcher.StateDone, nil, done.Stages
		return nil
	}
	if _, err := claim.Transition(ctx, h.records, change); err != nil {
		log.Debug("could not record the delivered answer yet; kept until NATS answers", logging.Err(err))
		h.ledger.Keep(job.ID, job.Submitted, change)
	}
}

// replyFailed ends a request whose reply stream failed, and stops its
// workers.
func (h *handlers) replyFailed(c echo.Context, ctx context.Context, sse *openai.SSEWriter, job *dispatcher.Job, err error, log *slog.Logger) error {
	if c.Request().Context().Err() != nil {
		h.cancel(job, log, dispatcher.StateCancelled, 499, "client went away")
		return nil
	}
	status, state := http.StatusBadGateway, dispatcher.StateFailed
	switch cause := context.Cause(ctx); {
	case errors.Is(cause, errDeadline):
		status, state, err = http.StatusGatewayTimeout, dispatcher.StateExpired, errDeadline
	case errors.Is(cause, errShutdown):
		status, err = http.StatusServiceUnavailable, errShutdown
	case errors.Is(err, errNATSDown):
		status = http.StatusServiceUnavailable
		c.Response().Header().Set("Retry-After", "5")
	case errors.Is(err, reply.ErrStalled):
		status, err = http.StatusGatewayTimeout, fmt.Errorf("%w for %v", err, h.cfg.StallTimeout)
	}
	log.Warn("reply failed", logging.Err(err), "status", status)
	h.cancel(job, log, state, status, err.Error())
	if state == dispatcher.StateFailed && status != http.StatusServiceUnavailable && !errors.Is(err, reply.ErrOverflow) {
		// Failed on pdq's side of the reply (a decode restarted after
		// output, as when its worker died; chunks lost; a decode gone
		// silent): no worker keeps it for replay, so the gateway does.
		// Not a client too slow for its stream: that is the client's.
		h.deadLetter(job, status, err, log)
	}
	apiErr := openai.NewError(status, "%v", err)
	trackOf(c).failed = true
	if sse != nil && sse.Started() {
		if err := sse.Error(apiErr); err != nil {
			log.Debug("could not write the in-stream error", logging.Err(err))
		}
		return nil
	}
	return writeError(c, apiErr)
}

// deadLetter keeps a request the gateway failed for pdq replay.
func (h *handlers) deadLetter(job *dispatcher.Job, status int, cause error, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := dispatcher.DeadLetterJob(ctx, h.js, job, dispatcher.StageDecode, status, cause.Error(), h.cfg.Counters.Shared()); err != nil {
		log.Warn("could not keep the failed request for replay", logging.Err(err))
	}
}

// writeWorkerError passes on an error a worker sent, with its status. The
// worker has recorded it.
func (h *handlers) writeWorkerError(c echo.Context, r reply.Reply) error {
	status := r.Status
	if status < 400 || status > 599 {
		status = http.StatusBadGateway
	}
	if status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable {
		c.Response().Header().Set("Retry-After", "5")
	}
	if _, ok := openai.ParseError(r.Data); !ok {
		return writeError(c, openai.NewError(status, "the request failed"))
	}
	return c.Blob(status, echo.MIMEApplicationJSON, r.Data)
}

// failed makes sure that the record of a request a worker failed says so.
// The worker writes it before it answers, but its write may not have been
// taken (a stream that does not store, see dispatcher/admin/doctor.go), and a
// record left queued keeps the id a 409 until its deadline. Most often the
// record has ended already, and this is one read.
func (h *handlers) failed(job *dispatcher.Job, r reply.Reply, log *slog.Logger) {
	status, why := r.Status, "the request failed"
	if e, ok := openai.ParseError(r.Data); ok {
		why = e.Message
	}
	state := dispatcher.StateFailed
	switch status {
	case http.StatusGatewayTimeout:
		state = dispatcher.StateExpired
	case 499:
		state = dispatcher.StateCancelled
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		h.ledger.Write(ctx, job.ID, job.Submitted, func(rec *dispatcher.Record) error {
			if rec.State.Ended() || rec.Gateway != h.id {
				return dispatcher.ErrNoChange
			}
			rec.State, rec.Error = state, &dispatcher.RecordError{Status: status, Message: why}
			return nil
		}, log)
	}()
}

// cancel ends a request the gateway gives up on: its record says so
// durably, for jobs still queued, and then the broadcast stops the running
// ones. A record another gateway (a client's retry) or a replay has taken
// over is left alone.
func (h *handlers) cancel(job *dispatcher.Job, log *slog.Logger, state dispatcher.State, status int, why string) {
	h.stop(job, log, state, status, why)
	log.Info("request stopped: "+why, "state", string(state))
}

// stop is cancel without its log line: for the other prompts of a batch,
// whose request has logged its end once.
func (h *handlers) stop(job *dispatcher.Job, log *slog.Logger, state dispatcher.State, status int, why string) {
	// Past the grace period the client is told only after this, and the
	// gateway closes its connection lastWords later: every stop then shares
	// one deadline, however many prompts a batch stops one by one.
	deadline := time.Now().Add(5 * time.Second)
	if end, over := h.relays.ended(); over {
		deadline = end.Add(lastWords / 2)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	// Not knowing, stop the work: it is ours unless the record says not.
	var theirs atomic.Bool
	h.ledger.Write(ctx, job.ID, job.Submitted, func(r *dispatcher.Record) error {
		if r.State.Ended() || r.Gateway != h.id {
			theirs.Store(true)
			return dispatcher.ErrNoChange
		}
		r.State, r.Error = state, &dispatcher.RecordError{Status: status, Message: why}
		return nil
	}, log)
	if !theirs.Load() {
		// Lost while NATS is out of reach: the record, written once it is
		// back, stops the work at its next beat.
		if err := submit.Cancel(h.nc, job.ID, job.Origin); err != nil && !natsGone(err) {
			log.Warn("could not publish the cancel", logging.Err(err))
		}
	}
}
