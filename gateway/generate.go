package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// generate serves one of the two generation endpoints: check, submit, and
// relay the reply.
func (h *handlers) generate(endpoint openai.Endpoint) echo.HandlerFunc {
	return func(c echo.Context) error {
		t := trackOf(c)
		clientID, id, apiErr := requestID(c.Request().Header.Get("X-Request-Id"))
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		c.Response().Header().Set("X-Request-Id", clientID)
		log := h.log.With(logging.KeyRequestID, id)
		if clientID != id {
			log = log.With("client_request_id", clientID)
		}

		body, release, apiErr := h.readBody(c)
		defer release()
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		in, apiErr := parseRequest(endpoint, body)
		if apiErr != nil && modelMissing(apiErr) {
			// As vLLM, the served model; looked for only when none was
			// named, so that a request that names one costs no more.
			withModel, filled, err := defaultModel(body, h.registry.Cards())
			switch {
			case err != nil:
				apiErr = err
			case filled:
				in, apiErr = parseRequest(endpoint, withModel)
			}
		}
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		if in.droppedKV {
			log.Warn("dropped kv_transfer_params sent by the client")
		}
		model := in.req.Model
		pool := h.registry.Status(model)
		if pool.Known {
			t.model = model // a client's made-up name must not become a series
		}
		switch {
		case pool.Decode == 0 && !pool.Known:
			return writeError(c, openai.NewError(http.StatusNotFound, "The model `%s` does not exist.", model).WithParam("model"))
		case pool.Decode == 0:
			return h.unavailable(c, "no live decode workers for model %s", model)
		}
		if apiErr := checkLength(endpoint, in.req, pool.MaxModelLen); apiErr != nil {
			return writeError(c, apiErr)
		}
		if !h.natsUp(c.Request().Context(), id) {
			log.Debug("refused: NATS is out of reach")
			return h.unavailable(c, "pdq cannot reach its queue (NATS); retry")
		}
		if bad, ok := h.doctor.NotStoring(); ok {
			log.Debug("refused: a stream does not store", "stream", bad.Stream)
			return h.unavailable(c, "pdq's queue cannot store (stream %s: its disk may be full); retry", bad.Stream)
		}
		if in.batch != nil {
			return h.generateBatch(c, endpoint, clientID, id, in, pool, log)
		}
		replies, job, claim, apiErr := h.submit(c, endpoint, id, clientID, false, in.req, in.body, in.promptTokens, pool, log)
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		defer replies.Close()
		return h.relay(c, replies, job, claim, newResponseIDs(endpoint, clientID, id), log.With("generation", job.Generation))
	}
}

// submit queues one job for body, through prefill or decode-only as the
// prompt's length and the pool's health decide, with its reply stream
// open before it is queued. The caller closes the stream. The claim is
// the request's record as written, for delivered. clientID is the
// client's X-Request-Id, for the record; batch marks a prompt of a
// batched request.
func (h *handlers) submit(c echo.Context, endpoint openai.Endpoint, id, clientID string, batch bool, req *openai.Request, body []byte,
	promptTokens int, pool registry.PoolStatus, log *slog.Logger) (*reply.Stream, *dispatcher.Job, *submit.Claim, *openai.Error) {
	model := req.Model
	stage := dispatcher.StagePrefill
	fallback := false
	if promptTokens < h.cfg.MinPromptTokens {
		stage = dispatcher.StageDecode
	} else if fallback = h.prefillDown(model, pool); fallback {
		if h.cfg.PrefillFallback == config.FallbackFail {
			c.Response().Header().Set("Retry-After", "5")
			return nil, nil, nil, openai.NewError(http.StatusServiceUnavailable, "no healthy prefill workers for model %s", model)
		}
		stage = dispatcher.StageDecode
	}
	replies, err := h.replies.Open(id)
	if err != nil {
		return nil, nil, nil, openai.NewError(http.StatusConflict, "a request with this X-Request-Id is in flight")
	}
	if !req.Stream {
		replies.Whole()
	}
	now := time.Now()
	job := &dispatcher.Job{
		ID: id, Model: model, Pool: dispatcher.PoolName(model), Endpoint: endpoint, Stream: req.Stream,
		Body: body, ReplyTo: h.replies.Subject(id), PromptTokens: promptTokens, ReplyBatch: true, ReplyFramed: true, BatchPrompt: batch,
		Owner:     callerOf(c).owner,
		Submitted: now, Deadline: now.Add(h.cfg.RequestTimeout),
	}
	if clientID != id {
		job.ClientID = clientID
	}
	slots := func() int { return h.registry.Slots(stage, job.Pool) }
	if err := h.admission.Check(c.Request().Context(), stage, job.Pool, slots); err != nil {
		replies.Close()
		return nil, nil, nil, h.submitFailed(c, err, log)
	}
	claim, err := h.submitter.Submit(c.Request().Context(), stage, job)
	if err != nil {
		replies.Close()
		h.unclaim(id, job.Submitted, err)
		return nil, nil, nil, h.submitFailed(c, err, log)
	}
	replies.Start(job.Generation)
	log.Debug("request queued", "model", model, "stage", string(stage), "stream", job.Stream,
		"prompt_tokens_estimate", promptTokens, "generation", job.Generation)
	switch {
	case fallback:
		h.cfg.Counters.Fallback(job.Pool, "gateway")
		h.cfg.Counters.DecodeOnly("no_healthy_prefill")
	case stage == dispatcher.StageDecode:
		h.cfg.Counters.DecodeOnly("short_prompt")
	}
	return replies, job, claim, nil
}

// prefillDown reports whether model's pool has no healthy prefill worker
// (none live, or every breaker open), and logs each change of that.
func (h *handlers) prefillDown(model string, pool registry.PoolStatus) bool {
	down := pool.PrefillHealthy == 0
	if was, _ := h.fallingBack.Swap(model, down); was != down && (was != nil || down) {
		if down {
			h.log.Warn("no healthy prefill worker for the model: long prompts go decode-only, prefilled by the decode engine",
				"model", model, "prefill_workers", pool.Prefill, "fallback", h.cfg.PrefillFallback)
		} else {
			h.log.Info("a prefill worker is healthy again: long prompts go through prefill", "model", model)
		}
	}
	return down
}

// natsUp reports whether NATS is connected, waiting up to a second for a
// reconnect in progress (a cluster node's loss moves the connection to
// another in milliseconds). The record writes for id (and its batch's
// prompts) that waited for NATS are made first, so that a retry of a
// request the outage ended finds it ended.
func (h *handlers) natsUp(ctx context.Context, id string) bool {
	for wait := time.Second; !h.nc.IsConnected(); wait -= 25 * time.Millisecond {
		if wait <= 0 || sleep.For(ctx, 25*time.Millisecond) != nil {
			return false
		}
	}
	if h.ledger.len() > 0 {
		h.ledger.flushFor(ctx, id)
	}
	return true
}

// unclaim ends the record of a claim whose submit failed, should it have
// been stored (a write whose answer was lost): a record left queued would
// make the id a 409 until its deadline. Refusals wrote nothing.
func (h *handlers) unclaim(id string, created time.Time, err error) {
	if errors.Is(err, dispatcher.ErrDuplicate) || errors.Is(err, dispatcher.ErrQueueFull) {
		return
	}
	h.ledger.keep(id, created, func(r *dispatcher.Record) error {
		if r.State.Ended() || r.Gateway != h.id {
			return dispatcher.ErrNoChange
		}
		r.State, r.Error = dispatcher.StateFailed, &dispatcher.RecordError{Status: http.StatusServiceUnavailable, Message: "not queued: " + err.Error()}
		return nil
	})
}

func (h *handlers) unavailable(c echo.Context, format string, args ...any) error {
	c.Response().Header().Set("Retry-After", "5")
	return writeError(c, openai.NewError(http.StatusServiceUnavailable, format, args...))
}

func (h *handlers) submitFailed(c echo.Context, err error, log *slog.Logger) *openai.Error {
	switch {
	case errors.Is(err, dispatcher.ErrDuplicate):
		return openai.NewError(http.StatusConflict,
			"a request with this X-Request-Id is in flight or has been answered; use a new id")
	case errors.Is(err, dispatcher.ErrQueueFull):
		wait := 5 * time.Second
		var full *submit.QueueFullError
		if errors.As(err, &full) {
			wait = full.RetryAfter
		}
		log.Warn("queue full: refusing the request", logging.Err(err), "retry_after_s", int(wait.Seconds()))
		c.Response().Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())))
		return openai.NewError(http.StatusTooManyRequests, "the queue is full; retry in %d s", int(wait.Seconds()))
	}
	c.Response().Header().Set("Retry-After", "5")
	if natsGone(err) {
		log.Warn("could not queue the request: NATS is out of reach", logging.Err(err))
		return openai.NewError(http.StatusServiceUnavailable, "pdq cannot reach its queue (NATS); retry")
	}
	if errors.Is(err, dispatcher.ErrNotStoring) {
		log.Warn("could not queue the request: a stream does not store", logging.Err(err))
		return openai.NewError(http.StatusServiceUnavailable, "pdq's queue cannot store (its disk may be full); retry")
	}
	log.Error("could not queue the request", logging.Err(err))
	return openai.NewError(http.StatusServiceUnavailable, "could not queue the request")
}

// natsGone reports whether err says the NATS connection is down (the
// gateway keeps no messages while it reconnects: see cmd/pdq).
func natsGone(err error) bool {
	return errors.Is(err, nats.ErrReconnectBufExceeded) || errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrNoServers) || errors.Is(err, nats.ErrDisconnected)
}

// relay writes the workers' reply to the client: the JSON body, or the SSE
// events flushed one by one. An error that comes before any output keeps
// its HTTP status; after that it can only be an in-stream error. Whatever
// ends the relay early, the workers are told to stop.
// ids, when not nil, puts the client's id back into the response ids.
func (h *handlers) relay(c echo.Context, replies *reply.Stream, job *dispatcher.Job, claim *submit.Claim, ids *responseIDs, log *slog.Logger) error {
	t := trackOf(c)
	ctx, cancel := h.relayContext(c, job.Deadline)
	defer cancel()
	first, err := h.next(ctx, replies, job)
	if err != nil {
		return h.replyFailed(c, ctx, nil, job, err, log)
	}
	switch first.Kind {
	case dispatcher.KindError:
		h.failed(job, first, log)
		return h.writeWorkerError(c, first)
	case dispatcher.KindDone:
		h.cancel(job, log, dispatcher.StateFailed, http.StatusBadGateway, "the engine sent an empty reply")
		return writeError(c, openai.NewError(http.StatusBadGateway, "the engine sent an empty reply"))
	}
	if !job.Stream {
		// The response, in parts if it was larger than a message: what
		// the gateway joins counts in its budget, as the parts did.
		answer := first.Data
		var end reply.Reply
		var held int64
		defer func() { h.budget.release(held) }()
		for {
			if end, err = h.next(ctx, replies, job); err != nil {
				return h.replyFailed(c, ctx, nil, job, err, log)
			}
			if end.Kind != dispatcher.KindChunk {
				break
			}
			if !h.budget.take(int64(len(end.Data))) {
				h.cancel(job, log, dispatcher.StateFailed, http.StatusServiceUnavailable, "the gateway holds PDQ_MAX_INFLIGHT_BYTES")
				return writeError(c, h.answerOverBudget(c))
			}
			held += int64(len(end.Data))
			answer = append(slices.Clip(answer), end.Data...)
		}
		if end.Kind == dispatcher.KindError {
			h.failed(job, end, log)
			return h.writeWorkerError(c, end)
		}
		t.wrote(h.cfg.Counters)
		if err := c.Blob(http.StatusOK, echo.MIMEApplicationJSON, ids.apply(answer)); err != nil {
			h.cancel(job, log, dispatcher.StateCancelled, 499, "client went away")
			return nil
		}
		h.delivered(job, claim, end, log)
		t.whole = true
		return nil
	}

	sse := openai.NewSSEWriter(c.Response())
	// Chunks are written as they come and flushed whenever no more are at
	// hand: one flush per burst, never a chunk held back.
	replies.OnIdle(sse.Flush)
	msg := first
	for {
		switch msg.Kind {
		case dispatcher.KindChunk:
			t.wrote(h.cfg.Counters)
			if err := sse.Write(ids.apply(msg.Data)); err != nil {
				h.cancel(job, log, dispatcher.StateCancelled, 499, "client went away")
				return nil
			}
		case dispatcher.KindDone:
			if err := sse.Done(); err != nil {
				log.Debug("client went away before [DONE]", logging.Err(err))
			}
			h.delivered(job, claim, msg, log)
			t.whole = true
			return nil
		case dispatcher.KindError:
			t.failed = true
			h.failed(job, msg, log)
			if err := sse.Data(msg.Data); err == nil {
				sse.Done()
			}
			return nil
		}
		if msg, err = h.next(ctx, replies, job); err != nil {
			if errors.Is(err, reply.ErrIdle) {
				h.cancel(job, log, dispatcher.StateCancelled, 499, "client went away")
				return nil
			}
			return h.replyFailed(c, ctx, sse, job, err, log)
		}
	}
}

// next reads the next reply. A decode that goes silent for the stall
// time-out fails the request, unless the request went back to prefill as a
// new generation (silent until its decode starts). Each silence, heard
// decode or not, looks at the request's record, so that an end whose
// message was lost (failed, cancelled, expired) still reaches the client.
func (h *handlers) next(ctx context.Context, replies *reply.Stream, job *dispatcher.Job) (reply.Reply, error) {
	for {
		r, err := replies.Next(ctx, h.cfg.StallTimeout)
		if !errors.Is(err, reply.ErrReplyStalled) {
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
		case gerr != nil || rec.Gateway != h.id || rec.State.Ended() || rec.Generation <= replies.Generation():
			return r, err
		}
		replies.Rearm()
	}
}

// errNATSDown fails a request whose reply went silent while NATS was out
// of reach: a 503, for the client to retry.
var errNATSDown = errors.New("pdq lost its connection to NATS during the request; retry it")

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
		h.ledger.keep(job.ID, job.Submitted, change)
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
	case errors.Is(err, reply.ErrReplyStalled):
		status, err = http.StatusGatewayTimeout, fmt.Errorf("%w for %v", err, h.cfg.StallTimeout)
	}
	log.Warn("reply failed", logging.Err(err), "status", status)
	h.cancel(job, log, state, status, err.Error())
	if state == dispatcher.StateFailed && status != http.StatusServiceUnavailable && !errors.Is(err, reply.ErrReplyOverflow) {
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
	if err := dispatcher.DeadLetterJob(ctx, h.js, job, dispatcher.StageDecode, status, cause.Error(), h.cfg.Counters); err != nil {
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
// taken (a stream that does not store, see dispatcher/doctor.go), and a
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
		h.ledger.write(ctx, job.ID, job.Submitted, func(rec *dispatcher.Record) error {
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
	h.ledger.write(ctx, job.ID, job.Submitted, func(r *dispatcher.Record) error {
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

// tracked is what the gateway measures of one request, for /metrics.
type tracked struct {
	arrived, first, last time.Time
	model                string
	itl                  prometheus.Observer // looked up at the first write
	whole                bool                // the answer went out whole
	failed               bool                // the request failed after its status was sent
}

const trackedKey = "pdq.tracked"

// trackOf is the request's tracked, or a throwaway one.
func trackOf(c echo.Context) *tracked {
	if t, ok := c.Get(trackedKey).(*tracked); ok {
		return t
	}
	return &tracked{}
}

// wrote notes a write of answer to the client: the first is the time to
// first token, the others the gaps between tokens.
func (t *tracked) wrote(m *dispatcher.Metrics) {
	now := time.Now()
	if t.first.IsZero() {
		t.first, t.itl = now, m.ITL(t.model)
	} else if t.itl != nil {
		t.itl.Observe(now.Sub(t.last).Seconds())
	}
	t.last = now
}

// track measures a generation request for /metrics, from its arrival
// (before the key check, so that a 401 counts too) to its answer.
func (h *handlers) track(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		t := &tracked{arrived: time.Now(), model: "unknown"}
		c.Set(trackedKey, t)
		defer h.account(c, t)
		defer h.cfg.Counters.GatewayRequest()() // in flight until answered
		return next(c)
	}
}

// account counts a request once it is answered, by its outcome.
func (h *handlers) account(c echo.Context, t *tracked) {
	status := c.Response().Status
	outcome := "error"
	switch {
	case t.whole:
		outcome = "ok"
	case c.Request().Context().Err() != nil:
		outcome = "cancelled"
	case t.failed || status >= 500 && status != http.StatusServiceUnavailable:
		outcome = "error"
	case status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable:
		outcome = "rejected"
	case status >= 400:
		outcome = "client_error"
	}
	var ttft, e2e time.Duration
	if !t.first.IsZero() {
		ttft = t.first.Sub(t.arrived)
	}
	if t.whole {
		e2e = time.Since(t.arrived)
	}
	h.cfg.Counters.Request(t.model, outcome, ttft, e2e)
}
