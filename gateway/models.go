package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/jsonobj"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// models lists the models of the live pools, each as its engine describes
// it in its own /v1/models (max_model_len, owned_by, root and parent of an
// adapter), so that a client sees what it would see at the engine.
func (h *handlers) models(c echo.Context) error {
	cards := h.registry.Cards()
	ids := make([]string, 0, len(cards))
	for id := range cards {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	list := struct {
		Object string            `json:"object"`
		Data   []json.RawMessage `json:"data"`
	}{Object: openai.ObjectList, Data: make([]json.RawMessage, 0, len(ids))}
	now := time.Now().Unix()
	for _, id := range ids {
		card := cards[id]
		if len(card) == 0 {
			// A worker that sent no card: what pdq knows of the model.
			card, _ = json.Marshal(openai.Model{ID: id, Object: openai.ObjectModel, Created: now,
				OwnedBy: "pdq", Root: id, Permission: []any{}})
		}
		list.Data = append(list.Data, cardAt(card, now))
	}
	return c.JSON(http.StatusOK, list)
}

// cardAt is an engine's model card as of now: vLLM builds its cards, and
// their permissions, for each call, so their created is the call's time,
// not the time the worker read the card. Anything else is the engine's.
func cardAt(card json.RawMessage, now int64) json.RawMessage {
	at := strconv.AppendInt(nil, now, 10)
	ops := []jsonobj.Op{jsonobj.Replace("created", at)}
	if perms, ok, err := jsonobj.Get(card, "permission"); err == nil && ok {
		if spans, err := jsonobj.Elements(perms); err == nil && len(spans) > 0 {
			var list []byte
			for i, sp := range spans {
				perm := []byte(perms[sp.Start:sp.End])
				if p, err := jsonobj.Edit(perm, jsonobj.Replace("created", at)); err == nil {
					perm = p
				}
				if i > 0 {
					list = append(list, ',')
				}
				list = append(list, perm...)
			}
			ops = append(ops, jsonobj.Replace("permission", array(list)))
		}
	}
	out, err := jsonobj.Edit(card, ops...)
	if err != nil {
		return card // not an object: as the engine sent it
	}
	return out
}

// ready answers 200 while the gateway can submit: NATS connected, the
// stage streams there, and the request records (every submit writes one
// first). Each is looked up afresh, on the server: a stream lost with a
// server's store, or a cluster without a leader for it, is a 503 until it
// is back.
func (h *handlers) ready(c echo.Context) error {
	if !h.nc.IsConnected() {
		return writeError(c, openai.NewError(http.StatusServiceUnavailable, "not connected to NATS (%s)", h.nc.Status()))
	}
	ctx, cancel := context.WithTimeout(c.Request().Context(), 2*time.Second)
	defer cancel()
	for _, name := range []string{dispatcher.StreamPrefill, dispatcher.StreamDecode} {
		if _, err := h.js.Stream(ctx, name); err != nil {
			return writeError(c, openai.NewError(http.StatusServiceUnavailable, "stream %s: %v", name, err))
		}
	}
	if _, err := h.js.KeyValue(ctx, dispatcher.BucketRequests); err != nil {
		return writeError(c, openai.NewError(http.StatusServiceUnavailable, "bucket %s: %v", dispatcher.BucketRequests, err))
	}
	if bad, ok := h.doctor.NotStoring(); ok {
		return writeError(c, openai.NewError(http.StatusServiceUnavailable,
			"stream %s does not store since %s (its disk may be full); it is rebuilt once the store can write: %s",
			bad.Stream, bad.Since.UTC().Format(time.RFC3339), bad.Error))
	}
	return c.NoContent(http.StatusOK)
}

// array wraps a list's members in brackets.
func array(members []byte) []byte {
	out := make([]byte, 0, len(members)+2)
	out = append(out, '[')
	out = append(out, members...)
	return append(out, ']')
}
