package gateway

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/affinity"
	"github.com/pdq-dev/pdq/dispatcher/fair"
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
		if h.cfg.FairQueue {
			turn, apiErr := h.waitTurn(c, endpoint, id, clientID, in, log)
			switch {
			case apiErr != nil:
				return writeError(c, apiErr)
			case turn == nil:
				return nil // the client left
			}
			defer turn.Done()
		}
		if in.batch != nil {
			return h.generateBatch(c, endpoint, clientID, id, in, pool, log)
		}
		replies, job, claim, apiErr := h.submit(c, endpoint, id, clientID, false, in.req, in.body, in.promptTokens, pool, log)
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		defer replies.Close()
		log = log.With("generation", job.Generation)
		return h.relay(c, []*leg{{job: job, claim: claim, replies: replies, log: log}}, ownIDs{newResponseIDs(endpoint, clientID, id)}, nil, job.Stream, log)
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
	fallback, bypass := false, false
	if promptTokens < h.cfg.MinPromptTokens {
		stage = dispatcher.StageDecode
	} else if fallback = h.prefillDown(model, pool); fallback {
		if h.cfg.PrefillFallback == config.FallbackFail {
			c.Response().Header().Set("Retry-After", "5")
			return nil, nil, nil, openai.NewError(http.StatusServiceUnavailable, "no healthy prefill workers for model %s", model)
		}
		stage = dispatcher.StageDecode
	} else if turn, ok := c.Get(turnKey).(*fair.Turn); ok && turn.Bypassed() && !batch {
		// It outranks the prefills let in, and every prefill engine
		// is taken: its decode engine computes the prompt at its next
		// step, rather than it wait for a prefill engine's to end.
		stage, bypass = dispatcher.StageDecode, true
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
		Body: body, ReplyTo: h.replies.Subject(id), PromptTokens: promptTokens, ReplyBatch: true, ReplyFramed: true, ReplyStart: h.turnsEndAtStart(), ReplyPrefilled: h.turnsEndAtStart(), BatchPrompt: batch,
		Owner:     callerOf(c).owner,
		Submitted: now, Deadline: now.Add(h.cfg.RequestTimeout),
	}
	if d, ok := c.Get(deadlineKey).(time.Time); ok && d.Before(job.Deadline) {
		job.Deadline = d // set as it began to wait for its turn (waitTurn)
	}
	if clientID != id {
		job.ClientID = clientID
	}
	slots := func() int { return h.registry.Slots(stage, job.Pool) }
	if err := h.admission.Check(c.Request().Context(), stage, job.Pool, slots); err != nil {
		replies.Close()
		return nil, nil, nil, h.submitFailed(c, err, log)
	}
	// Placed only once admitted, and in the index only once sent: a
	// request refused would leave its prompt there, where it never went.
	sent := func() {}
	if h.placer != nil && !batch {
		hashes, ok := c.Get(hashesKey).(func() []uint64) // hashed already for its turn
		if !ok {
			hashes = sync.OnceValue(func() []uint64 { return affinity.PromptHashes(endpoint, req) })
		}
		if stage == dispatcher.StagePrefill {
			var placed func()
			if h.turnsEndAtStart() {
				// The prefill's end names its engine: a prompt new to
				// every engine goes to the first free one, as the
				// workers' pulls know which engine has a seat free and
				// this gateway's count does not.
				var learn func(string)
				job.Prefer, sent, placed, learn = h.placer.PlaceLearning(hashes, h.registry.Engines(stage, job.Pool))
				if learn != nil {
					replies.OnPrefilledOn(learn)
				}
			} else {
				job.Prefer, sent, placed = h.placer.Place(hashes, h.registry.Engines(stage, job.Pool))
			}
			// The engine is free of it once its prefill ends (see
			// affinity.Placer), or when the request ends: its context
			// ends with its handler.
			replies.OnStarted(placed)
			context.AfterFunc(c.Request().Context(), placed)
		}
		// The decode engine caches the prompt too: a conversation's next
		// turn there reads only its new blocks from the prefill engine,
		// and a decode-only one computes only those. Its engine is busy
		// with it until the request ends.
		// Only while every decode worker of the pool takes the jobs that
		// prefer its engine: one of an earlier build, or with affinity
		// off, takes over none, and might idle while they wait.
		decoders := h.registry.Engines(dispatcher.StageDecode, job.Pool)
		if dispatcher.AllTakePreferred(decoders) {
			var sentDecode, decoded func()
			job.PreferDecode, sentDecode, decoded = h.decodePlacer.Place(hashes, decoders)
			context.AfterFunc(c.Request().Context(), decoded)
			sentPrefill := sent
			sent = func() { sentPrefill(); sentDecode() }
		}
	}
	claim, err := h.submitter.Submit(c.Request().Context(), stage, job)
	if err != nil {
		replies.Close()
		h.unclaim(id, job.Submitted, err)
		return nil, nil, nil, h.submitFailed(c, err, log)
	}
	sent()
	replies.Start(job.Generation)
	log.Debug("request queued", "model", model, "stage", string(stage), "stream", job.Stream,
		"prompt_tokens_estimate", promptTokens, "generation", job.Generation, "prefer", job.Prefer, "prefer_decode", job.PreferDecode)
	switch {
	case fallback:
		h.cfg.Counters.Shared().Fallback(job.Pool, "gateway")
		h.cfg.Counters.Shared().DecodeOnly("no_healthy_prefill")
	case bypass:
		h.cfg.Counters.Shared().DecodeOnly("priority")
	case stage == dispatcher.StageDecode:
		h.cfg.Counters.Shared().DecodeOnly("short_prompt")
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
	if h.ledger.Len() > 0 {
		h.ledger.FlushFor(ctx, id)
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
	h.ledger.Keep(id, created, func(r *dispatcher.Record) error {
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
