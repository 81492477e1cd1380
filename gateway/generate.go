package gateway

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// generate serves one of the two generation endpoints: check, submit, and
// relay the reply.
func (h *handlers) generate(endpoint openai.Endpoint) echo.HandlerFunc {
	return func(c echo.Context) error {
		id, apiErr := requestID(c.Request().Header.Get("X-Request-Id"))
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		c.Response().Header().Set("X-Request-Id", id)
		log := h.log.With(logging.KeyRequestID, id)

		body, apiErr := h.readBody(c)
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		in, apiErr := parseRequest(endpoint, body)
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		if in.droppedKV {
			log.Warn("dropped kv_transfer_params sent by the client")
		}
		model := in.req.Model
		pool := h.registry.Status(model)
		switch {
		case pool.Decode == 0 && !pool.Known:
			return writeError(c, openai.NewError(http.StatusNotFound, "The model `%s` does not exist.", model).WithParam("model"))
		case pool.Decode == 0:
			return h.unavailable(c, "no live decode workers for model %s", model)
		}
		stage := dispatcher.StagePrefill
		if in.promptTokens < h.cfg.MinPromptTokens {
			stage = dispatcher.StageDecode
		} else if pool.Prefill == 0 {
			return h.unavailable(c, "no live prefill workers for model %s", model)
		}

		replies, err := h.replies.Open(id)
		if err != nil {
			return writeError(c, openai.NewError(http.StatusConflict, "a request with X-Request-Id %s is in flight", id))
		}
		defer replies.Close()
		job := &dispatcher.Job{
			ID: id, Model: model, Pool: dispatcher.PoolName(model), Endpoint: endpoint, Stream: in.req.Stream,
			Body: in.body, ReplyTo: h.replies.Subject(id), PromptTokens: in.promptTokens, SubmittedAt: time.Now(),
		}
		if err := h.submitter.Submit(c.Request().Context(), stage, job); err != nil {
			return h.submitFailed(c, err, log)
		}
		log.Debug("request queued", "model", model, "stage", string(stage), "stream", job.Stream,
			"prompt_tokens_estimate", in.promptTokens)
		if stage == dispatcher.StageDecode {
			log.Info("decode-only: short prompt skips prefill", "prompt_tokens_estimate", in.promptTokens,
				"threshold", h.cfg.MinPromptTokens)
		}
		return h.relay(c, replies, job, log)
	}
}

func (h *handlers) unavailable(c echo.Context, format string, args ...any) error {
	c.Response().Header().Set("Retry-After", "5")
	return writeError(c, openai.NewError(http.StatusServiceUnavailable, format, args...))
}

func (h *handlers) submitFailed(c echo.Context, err error, log *slog.Logger) error {
	switch {
	case errors.Is(err, dispatcher.ErrDuplicate):
		return writeError(c, openai.NewError(http.StatusConflict,
			"a request with this X-Request-Id was accepted in the last few minutes; use a new id"))
	case errors.Is(err, dispatcher.ErrQueueFull):
		log.Warn("queue full: refusing the request", logging.Err(err))
		c.Response().Header().Set("Retry-After", "1")
		return writeError(c, openai.NewError(http.StatusTooManyRequests, "the queue is full; retry shortly"))
	}
	log.Error("could not queue the request", logging.Err(err))
	return h.unavailable(c, "could not queue the request")
}

// relay writes the workers' reply to the client: the JSON body, or the SSE
// events flushed one by one. An error that comes before any output keeps
// its HTTP status; after that it can only be an in-stream error.
func (h *handlers) relay(c echo.Context, replies *dispatcher.ReplyStream, job *dispatcher.Job, log *slog.Logger) error {
	ctx := c.Request().Context()
	first, err := replies.Next(ctx, h.cfg.IdleTimeout)
	if err != nil {
		return h.replyFailed(c, nil, job, err, log)
	}
	switch first.Kind {
	case dispatcher.KindError:
		return h.writeWorkerError(c, first)
	case dispatcher.KindDone:
		return writeError(c, openai.NewError(http.StatusBadGateway, "the engine sent an empty reply"))
	}
	if !job.Stream {
		end, err := replies.Next(ctx, h.cfg.IdleTimeout)
		if err != nil {
			return h.replyFailed(c, nil, job, err, log)
		}
		if end.Kind == dispatcher.KindError {
			return h.writeWorkerError(c, end)
		}
		if end.Kind != dispatcher.KindDone {
			return writeError(c, openai.NewError(http.StatusBadGateway, "the engine sent more than one response"))
		}
		return c.Blob(http.StatusOK, echo.MIMEApplicationJSON, first.Data)
	}

	sse := openai.NewSSEWriter(c.Response())
	msg := first
	for {
		switch msg.Kind {
		case dispatcher.KindChunk:
			if err := sse.Data(msg.Data); err != nil {
				h.cancel(job.ID, log, "client went away")
				return nil
			}
		case dispatcher.KindDone:
			if err := sse.Done(); err != nil {
				log.Debug("client went away before [DONE]", logging.Err(err))
			}
			return nil
		case dispatcher.KindError:
			if err := sse.Data(msg.Data); err == nil {
				sse.Done()
			}
			return nil
		}
		if msg, err = replies.Next(ctx, h.cfg.IdleTimeout); err != nil {
			return h.replyFailed(c, sse, job, err, log)
		}
	}
}

// replyFailed ends a request whose reply stream failed.
func (h *handlers) replyFailed(c echo.Context, sse *openai.SSEWriter, job *dispatcher.Job, err error, log *slog.Logger) error {
	if errors.Is(err, context.Canceled) || c.Request().Context().Err() != nil {
		h.cancel(job.ID, log, "client went away")
		return nil
	}
	status := http.StatusBadGateway
	if errors.Is(err, dispatcher.ErrReplyTimeout) {
		status = http.StatusGatewayTimeout
		h.cancel(job.ID, log, "no reply in time")
	}
	log.Error("reply failed", logging.Err(err))
	apiErr := openai.NewError(status, "%v", err)
	if sse != nil && sse.Started() {
		if err := sse.Error(apiErr); err != nil {
			log.Debug("could not write the in-stream error", logging.Err(err))
		}
		return nil
	}
	return writeError(c, apiErr)
}

// writeWorkerError passes on an error a worker sent, with its status.
func (h *handlers) writeWorkerError(c echo.Context, r dispatcher.Reply) error {
	status := r.Status
	if status < 400 || status > 599 {
		status = http.StatusBadGateway
	}
	if _, ok := openai.ParseError(r.Data); !ok {
		return writeError(c, openai.NewError(status, "the request failed"))
	}
	return c.Blob(status, echo.MIMEApplicationJSON, r.Data)
}

// cancel tells the workers to stop a request nobody waits for any more.
func (h *handlers) cancel(id string, log *slog.Logger, why string) {
	if err := h.nc.Publish(dispatcher.CancelSubject(id), nil); err != nil {
		log.Warn("could not publish the cancel", logging.Err(err))
		return
	}
	log.Info("request cancelled: " + why)
}
