package gateway

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// request serves GET /v1/requests/{id}: the request's record, with where a
// live request stands read from the stream its message sits in. id is the
// client's X-Request-Id (path-escaped), or the request's key
// (dispatcher.RequestKey).
func (h *handlers) request(c echo.Context) error {
	param := c.Param("id")
	if c.Request().URL.RawPath != "" {
		// The router matched the escaped path: its segment is still
		// escaped (an id with '/', say).
		var err error
		if param, err = url.PathUnescape(param); err != nil {
			return writeError(c, openai.NewError(http.StatusBadRequest, "request id: %v", err))
		}
	}
	id, err := dispatcher.RequestKey(param)
	if err != nil {
		return writeError(c, openai.NewError(http.StatusBadRequest, "%v", err))
	}
	ctx, cancel := context.WithTimeout(c.Request().Context(), 5*time.Second)
	defer cancel()
	rec, err := dispatcher.ReadRecord(ctx, h.js, h.records, param)
	if who := callerOf(c); err == nil && !who.operator && rec.Owner != who.owner {
		// Another key's request: as if there were none, so that its
		// existence does not show either.
		err = dispatcher.ErrNoRecord
	}
	if errors.Is(err, dispatcher.ErrNoRecord) {
		return writeError(c, openai.NewError(http.StatusNotFound, "no request %s in the last 24 hours", id))
	}
	if err != nil {
		return h.unavailable(c, "could not read the request record: %v", err)
	}
	return c.JSON(http.StatusOK, rec)
}
