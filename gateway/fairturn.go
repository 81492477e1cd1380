package gateway

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/fair"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// deadlineKey holds, in a request's echo context, its deadline as set when
// it began to wait for its turn.
const deadlineKey = "pdq.deadline"

// fairRetryAfter is the Retry-After, in seconds, of a request refused for
// its tenant's share of the queue: its tenant's requests wait already.
const fairRetryAfter = 5

// waitTurn holds a request in its pool's fair queue until the pool has
// room for it; done is to be called when the request ends. A tenant over
// its share gets a 429, a request whose deadline passes while it waits a
// 504; a client that leaves while it waits gets nothing (done and apiErr
// both nil).
func (h *handlers) waitTurn(c echo.Context, endpoint openai.Endpoint, in *incoming, log *slog.Logger) (done func(), apiErr *openai.Error) {
	pool := dispatcher.PoolName(in.req.Model)
	q := h.fairQueue(pool)
	// The request's deadline runs from now: its jobs carry what is left of
	// it, not a fresh one from when it goes in (see submit).
	deadline := time.Now().Add(h.cfg.RequestTimeout)
	c.Set(deadlineKey, deadline)
	ctx, cancel := context.WithDeadline(c.Request().Context(), deadline)
	defer cancel()
	cost := in.promptTokens
	for _, n := range in.batchTokens {
		cost += n
	}
	if n, ok := in.req.OutputLimit(endpoint); ok {
		cost += n
	}
	tenant := tenantOf(c, in.req)
	done, err := q.Enter(ctx, tenant, in.req.Priority, cost)
	switch {
	case err == nil:
		return done, nil
	case errors.Is(err, fair.ErrTenantFull):
		log.Debug("refused: the tenant's share of the queue is full", "tenant", tenant)
		c.Response().Header().Set("Retry-After", strconv.Itoa(fairRetryAfter))
		return nil, openai.NewError(http.StatusTooManyRequests, "the queue is full; retry in %d s", fairRetryAfter)
	case c.Request().Context().Err() != nil:
		log.Debug("the client left while its request waited for its turn")
		return nil, nil
	}
	return nil, openai.NewError(http.StatusGatewayTimeout, "the request's deadline passed %s", "while it waited for its turn")
}

// fairQueue is pool's fair queue. Its limit is the most the pool's
// workers take at once, prefill and decode (their PDQ_ENGINE_SLOTS):
// beyond that, a request would only wait in JetStream's queue, first come
// first served. Not their engines' seats as seen so far, which grow only
// with jobs beyond them.
func (h *handlers) fairQueue(pool string) *fair.Queue {
	if q, ok := h.queues.Load(pool); ok {
		return q.(*fair.Queue)
	}
	q, _ := h.queues.LoadOrStore(pool, fair.New(h.cfg.MaxQueue,
		func(tenant string) float64 { return h.cfg.TenantWeights[tenant] },
		func() int {
			return max(1, h.registry.MostSlots(dispatcher.StagePrefill, pool)+h.registry.MostSlots(dispatcher.StageDecode, pool))
		}))
	return q.(*fair.Queue)
}

// tenantOf is who a request is for, in the fair queue: its API key's
// owner on a gateway that takes keys, else the body's "user" ("" for
// none).
func tenantOf(c echo.Context, req *openai.Request) string {
	if owner := callerOf(c).owner; owner != "" {
		return owner
	}
	return req.User
}
