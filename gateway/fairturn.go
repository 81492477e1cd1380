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

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/affinity"
	"github.com/pdq-dev/pdq/dispatcher/fair"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// deadlineKey holds, in a request's echo context, its deadline as set when
// it began to wait for its turn; turnKey its turn (PDQ_FAIR_LIMIT=engines), which the relay tells
// when its prefill ends or a decode of it is heard from; hashesKey its prompt's chunk hashes
// (a func() []uint64, computed once), for its placement.
const (
	deadlineKey = "pdq.deadline"
	turnKey     = "pdq.turn"
	hashesKey   = "pdq.hashes"
)

// fairRetryAfter is the Retry-After, in seconds, of a request refused for
// its tenant's share of the queue: its tenant's requests wait already.
const fairRetryAfter = 5

// waitTurn holds a request in its pool's fair queue until the pool has
// room for it; the turn's Done is to be called when the request ends (its
// Started, the relay has called once its prefill ends or a decode of it
// is heard from). A
// tenant over its share gets a 429, a request whose deadline passes while
// it waits a 504; a client that leaves while it waits gets nothing (turn
// and apiErr both nil).
func (h *handlers) waitTurn(c echo.Context, endpoint openai.Endpoint, id, clientID string, in *incoming, log *slog.Logger) (turn *fair.Turn, apiErr *openai.Error) {
	pool := dispatcher.PoolName(in.req.Model)
	q := h.fairQueue(pool)
	// The request's deadline runs from now: its jobs carry what is left of
	// it, not a fresh one from when it goes in (see submit).
	deadline := time.Now().Add(h.cfg.RequestTimeout)
	c.Set(deadlineKey, deadline)
	ctx, cancel := context.WithDeadline(c.Request().Context(), deadline)
	defer cancel()
	prompt := in.promptTokens
	for _, n := range in.batchTokens {
		prompt += n
	}
	cost := prompt
	if n, ok := in.req.OutputLimit(endpoint); ok {
		cost += n
	}
	// What it holds of the pool's limit is what the engines will compute:
	// not the part an engine's prefix cache likely holds (its bytes, at
	// four a token, as prompt tokens are estimated).
	load := prompt
	if h.turnsEndAtStart() && h.placer != nil && in.batch == nil {
		hashes := sync.OnceValue(func() []uint64 { return affinity.PromptHashes(endpoint, in.req) })
		c.Set(hashesKey, hashes)
		cached := h.placer.Cached(hashes, h.registry.Engines(dispatcher.StagePrefill, pool))
		load = max(1, prompt-cached/4)
	}
	tenant := tenantOf(c, in.req)
	// A single streamed prompt may go decode-only (see submit): its
	// bypass ends at its first token. A non-streamed answer's first write
	// is its last, which would hold the bypass for the whole decode.
	enter := q.EnterOrBypass
	if in.batch != nil || !in.req.Stream {
		enter = q.Enter
	}
	turn, err := enter(ctx, tenant, in.req.Priority, cost, load)
	switch {
	case err == nil:
		if h.turnsEndAtStart() {
			c.Set(turnKey, turn) // for the relay to end it as the prefill ends or the decode starts
		}
		return turn, nil
	case errors.Is(err, fair.ErrTenantFull):
		log.Debug("refused: the tenant's share of the queue is full", "tenant", tenant)
		c.Response().Header().Set("Retry-After", strconv.Itoa(fairRetryAfter))
		return nil, openai.NewError(http.StatusTooManyRequests, "the queue is full; retry in %d s", fairRetryAfter)
	case c.Request().Context().Err() != nil:
		log.Debug("the client left while its request waited for its turn")
		h.endWaiting(c, endpoint, id, clientID, in.req, deadline, dispatcher.StateCancelled, 499, errClientGone.Error(), log)
		return nil, nil
	}
	apiErr = openai.NewError(http.StatusGatewayTimeout, "the request's deadline passed %s", "while it waited for its turn")
	h.endWaiting(c, endpoint, id, clientID, in.req, deadline, dispatcher.StateExpired, apiErr.Status(), apiErr.Message, log)
	return nil, apiErr
}

// endWaiting records a request that ended while it waited for its turn:
// its id was not claimed yet, but a request that was taken leaves a record
// of how it ended (pdq requests, GET /v1/requests/{id}), as one that ended
// in JetStream's queue does (see submit.Submitter.Unrun).
func (h *handlers) endWaiting(c echo.Context, endpoint openai.Endpoint, id, clientID string, req *openai.Request, deadline time.Time,
	state dispatcher.State, status int, why string, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(c.Request().Context()), lastWords)
	defer cancel()
	job := &dispatcher.Job{ID: id, Model: req.Model, Pool: dispatcher.PoolName(req.Model), Endpoint: endpoint, Stream: req.Stream,
		ReplyTo: h.replies.Subject(id), Owner: callerOf(c).owner, Submitted: time.Now(), Deadline: deadline}
	if clientID != id {
		job.ClientID = clientID
	}
	if err := h.submitter.Unrun(ctx, job, state, &dispatcher.RecordError{Status: status, Message: why}); err != nil {
		log.Debug("no record of a request that ended while it waited for its turn", logging.Err(err))
	}
}

// fairQueue is pool's fair queue. With PDQ_FAIR_LIMIT=engines a request
// holds its turn until its first stage frees its engine (Job.ReplyStart:
// its prefill worker tells as the prefill ends, or a moment before; a
// decode-only request's decode worker beats at once as it starts): until
// then it waits for a prefill, or runs one, and more of them
// in the engines or queues would only wait there, first come first
// served, or slow each other's prefills alike in the engines' batches.
// The pool lets in, and not started, one request an engine of its first
// stage (prefill, or decode in a pool without prefill workers), or more
// while the prompt tokens they leave the engines to compute (those no
// prefix cache likely holds) are at most FairLoad an engine: about one
// prompt at a time an engine, where a prefill's cost grows with its
// tokens, and small or mostly cached prompts together, up to twice the
// seats the workers saw their engines run (so that the seats they learn
// can grow), within the workers' slots. While every request let in or
// waiting is of one tenant and one priority, there is no order to keep:
// twice that load goes in, for the engines to batch (the throughput of a
// step's shared cost, the hand-off hidden); another tenant or priority
// puts the bound back.
//
// A request that outranks the work let in (fair.Limit.Bypass) goes in
// beside the limit, one a healthy decode engine at a time, and runs
// decode-only (see submit): its decode engine computes its prompt at its
// next step, rather than it wait for a prefill engine's long step to end.
//
// With PDQ_FAIR_LIMIT=slots (the default) the pool holds instead as many
// requests as its workers have slots, prefill and decode, each for its
// whole life: the queue orders only what goes beyond them.
func (h *handlers) fairQueue(pool string) *fair.Queue {
	if q, ok := h.queues.Load(pool); ok {
		return q.(*fair.Queue)
	}
	limit := func() fair.Limit {
		return fair.Limit{Requests: max(1, h.registry.MostSlots(dispatcher.StagePrefill, pool)+h.registry.MostSlots(dispatcher.StageDecode, pool))}
	}
	if h.turnsEndAtStart() {
		limit = func() fair.Limit {
			stage := dispatcher.StagePrefill
			engines := len(h.registry.Engines(stage, pool))
			if engines == 0 {
				stage = dispatcher.StageDecode
				engines = len(h.registry.Engines(stage, pool))
			}
			engines = max(engines, 1)
			most := min(2*h.registry.SeatsSeen(stage, pool), h.registry.MostSlots(stage, pool))
			// A request that outranks the prefills let in goes
			// decode-only rather than wait for a prefill engine:
			// about one a decode engine at a time (see submit).
			bypass := 0
			if stage == dispatcher.StagePrefill {
				bypass = len(h.registry.Engines(dispatcher.StageDecode, pool))
			}
			// Twice the prompt tokens an engine (about two long
			// prompts) while the work is of one tenant and one
			// priority: no order to keep, and the engines batch them
			// (fair.Limit.AlikeLoad).
			return fair.Limit{Requests: engines, Most: most, Load: engines * h.cfg.FairLoad, AlikeLoad: 2 * engines * h.cfg.FairLoad, Bypass: bypass}
		}
	}
	q, _ := h.queues.LoadOrStore(pool, fair.New(h.cfg.MaxQueue, func(tenant string) float64 { return h.cfg.TenantWeights[tenant] }, limit))
	return q.(*fair.Queue)
}

// turnsEndAtStart says whether a request's turn in the fair queue ends
// once its prefill ends or its decode starts (PDQ_FAIR_LIMIT=engines),
// not when it ends.
func (h *handlers) turnsEndAtStart() bool {
	return h.cfg.FairQueue && h.cfg.FairLimit == config.FairLimitEngines
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
