package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"math/rand/v2"
	"net/http"
	"slices"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/enginecall"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// engineCallTimeout bounds an engine call; the worker gets the deadline.
const engineCallTimeout = 60 * time.Second

// engineCall serves one of vLLM's other endpoints (/tokenize, /detokenize,
// /version, /v1/embeddings) by the engine of a healthy decode worker of
// the request's model, over NATS (enginecall.Call). The engine's
// status and body come back as it sent them. A request without a model
// goes to the only model served, as vLLM's own default would.
func (h *handlers) engineCall(c echo.Context) error {
	var body []byte
	model := ""
	if c.Request().Method == http.MethodPost {
		b, release, apiErr := h.readBody(c)
		defer release()
		if apiErr != nil {
			return writeError(c, apiErr)
		}
		var req struct {
			Model string `json:"model"`
		}
		if err := json.Unmarshal(b, &req); err != nil {
			return writeError(c, openai.NewError(http.StatusBadRequest, "request body must be a JSON object: %v", err))
		}
		body, model = b, req.Model
	}
	var workers []dispatcher.WorkerInfo
	if model == "" {
		ids := slices.Sorted(maps.Keys(h.registry.Cards()))
		if len(ids) > 1 && c.Request().Method == http.MethodPost {
			return writeError(c, modelRequired(ids))
		}
		for _, m := range ids { // any model's engine knows its version
			if workers = h.registry.Decoders(m); len(workers) > 0 {
				model = m
				break
			}
		}
		if model == "" {
			return h.unavailable(c, "no healthy decode workers")
		}
	} else {
		workers = h.registry.Decoders(model)
	}
	if len(workers) == 0 {
		if !h.registry.Status(model).Known {
			return writeError(c, openai.NewError(http.StatusNotFound, "The model `%s` does not exist.", model).WithParam("model"))
		}
		return h.unavailable(c, "no healthy decode workers for model %s", model)
	}
	ctx, cancel := context.WithTimeout(c.Request().Context(), engineCallTimeout)
	defer cancel()
	call := enginecall.Request{ID: "call-" + newUUID(), Method: c.Request().Method, Path: c.Request().URL.RequestURI(), Body: body}
	answered := false
	defer func() {
		if !answered {
			// The client went away, or no answer came in time: the
			// engine's work stops, wherever the call waits.
			if err := h.nc.Publish(dispatcher.CancelSubject(call.ID), nil); err != nil {
				h.log.Debug("could not publish the cancel of an engine call", logging.Err(err))
			}
		}
	}()
	// A call no worker answers (one gone since its last heartbeat) is
	// tried again on a worker picked at random, up to three tries.
	var err error
	for try := 0; try < 3; try++ {
		w := workers[rand.IntN(len(workers))]
		var a enginecall.Answer
		a, err = enginecall.Call(ctx, h.nc, w.WorkerID(), call)
		if err == nil {
			answered = true
			ct := a.ContentType
			if ct == "" {
				ct = echo.MIMEApplicationJSON
			}
			return c.Blob(a.Status, ct, a.Body)
		}
		if !errors.Is(err, enginecall.ErrNoAnswer) || ctx.Err() != nil {
			break
		}
	}
	if c.Request().Context().Err() != nil {
		return nil // the client went away
	}
	h.log.Warn("engine call failed", logging.Err(err), "path", c.Path(), "model", model)
	status := http.StatusBadGateway
	if errors.Is(err, enginecall.ErrNoAnswer) {
		status = http.StatusGatewayTimeout
	}
	return writeError(c, openai.NewError(status, "no decode worker answered: %v", err))
}
