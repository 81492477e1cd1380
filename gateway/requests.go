package gateway

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// request serves GET /v1/requests/{id}: the request's record, with where a
// live request stands read from the stream its message sits in.
func (h *handlers) request(c echo.Context) error {
	id := c.Param("id")
	if !dispatcher.ValidRequestID(id) {
		return writeError(c, openai.NewError(http.StatusBadRequest,
			"invalid request id: use 1 to 128 characters from A-Z, a-z, 0-9, '_' and '-'"))
	}
	ctx, cancel := context.WithTimeout(c.Request().Context(), 5*time.Second)
	defer cancel()
	rec, err := dispatcher.ReadRecord(ctx, h.js, h.records, id)
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
