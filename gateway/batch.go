package gateway

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/pkg/jsonobj"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// A completions request may carry a batch of prompts. vLLM's NIXL handoff
// carries the KV of one prompt only (its completion serving returns the
// kv_transfer_params of the batch's first prompt), so a batch cannot go
// through prefill whole: the gateway splits it into one job per prompt,
// each with the client's body and that one prompt, under the ids
// <id>-0, <id>-1, ..., and merges the answers into the shape vLLM gives a
// batch: one response id (cmpl-<id>), choice i*n+j for choice j of prompt
// i, and usage summed.

// maxBatch bounds the prompts of one request: each becomes a job.
const maxBatch = 256

// generateBatch serves a completions request with several prompts.
// clientID is the client's X-Request-Id, id the request's key
// (dispatcher.RequestKey), which leaves room for every prompt's -<i>.
func (h *handlers) generateBatch(c echo.Context, endpoint openai.Endpoint, clientID, id string, in *incoming, pool registry.PoolStatus, log *slog.Logger) error {
	if len(in.batch) > maxBatch {
		return writeError(c, openai.NewError(http.StatusBadRequest, "'prompt' holds %d prompts; at most %d are served in one request", len(in.batch), maxBatch).WithParam("prompt"))
	}
	// Each prompt's body repeats the client's other fields: what exceeds
	// the body already counted is held too, and reserved before it is
	// built.
	all, _, err := jsonobj.Get(in.body, "prompt")
	if err != nil {
		return writeError(c, openai.NewError(http.StatusBadRequest, "request body: %v", err))
	}
	extra := -int64(len(in.body))
	for _, prompt := range in.batch {
		extra += int64(len(in.body) - len(all) + len(prompt))
	}
	if extra > h.cfg.MaxBodyBytes || int64(len(in.body))+extra > h.cfg.MaxInflightBytes {
		// Never to fit: a 413, not a 429 to retry.
		return writeError(c, openai.NewError(http.StatusRequestEntityTooLarge,
			"the batch's %d prompts, each with the request's other fields, come to %d bytes more than the request; at most %d",
			len(in.batch), extra, min(h.cfg.MaxBodyBytes, h.cfg.MaxInflightBytes-int64(len(in.body)))))
	}
	if extra > 0 {
		if !h.budget.take(extra) {
			return writeError(c, h.overBudget(c))
		}
		defer h.budget.release(extra)
	}
	// The batch is one request under its id, like any other: claimed
	// before its prompts are queued, ended with them.
	parent, apiErr := h.claimBatch(c, endpoint, clientID, id, in, log)
	if apiErr != nil {
		return writeError(c, apiErr)
	}
	defer h.endBatch(c, parent, log)
	bodies := make([][]byte, len(in.batch))
	for i, prompt := range in.batch {
		if bodies[i], err = jsonobj.Edit(in.body, jsonobj.Set("prompt", prompt)); err != nil {
			return writeError(c, openai.NewError(http.StatusBadRequest, "request body: %v", err))
		}
	}
	jobs := make([]*leg, 0, len(in.batch))
	defer func() {
		for _, b := range jobs {
			b.replies.Close()
		}
	}()
	for i, body := range bodies {
		sub := id + "-" + strconv.Itoa(i)
		jlog := h.log.With(logging.KeyRequestID, sub)
		replies, job, claim, apiErr := h.submit(c, endpoint, sub, sub, true, in.req, body, in.batchTokens[i], pool, jlog)
		if apiErr != nil {
			// The prompts queued so far must not run for nobody.
			for _, b := range jobs {
				h.stop(b.job, b.log, dispatcher.StateCancelled, apiErr.Status(), "another prompt of its batch was refused")
			}
			parent.end(dispatcher.StateFailed, apiErr.Status(), fmt.Sprintf("prompt %d was refused: %s", i, apiErr.Message))
			return writeError(c, apiErr)
		}
		jobs = append(jobs, &leg{job: job, claim: claim, replies: replies, log: jlog})
	}
	n := 1
	if in.req.N != nil {
		n = *in.req.N
	}
	return h.relay(c, jobs, openai.NewBatchMerge(openai.Completions.IDPrefix()+clientID, n), parent, in.req.Stream, log)
}

// batchRecord is the record of a batched request's own id, whose prompts
// run under <id>-<i>: it makes the id one request, so that a single
// request cannot take it while the batch runs or after it was answered.
type batchRecord struct {
	claim *submit.Claim
	rec   *dispatcher.Record
	// state and err are the first end the batch came to; state is empty
	// while it has come to none.
	state dispatcher.State
	err   *dispatcher.RecordError
}

// end notes how the batch ended; the first end stands. A single
// request, with no batch record, has nothing to note.
func (b *batchRecord) end(state dispatcher.State, status int, why string) {
	if b != nil && b.state == "" {
		b.state, b.err = state, &dispatcher.RecordError{Status: status, Message: why}
	}
}

// claimBatch claims the batch's id in its record, as Submit claims a
// job's: an id that is live or has delivered is a 409, one that ended
// without delivering is retried.
func (h *handlers) claimBatch(c echo.Context, endpoint openai.Endpoint, clientID, id string, in *incoming, log *slog.Logger) (*batchRecord, *openai.Error) {
	now := time.Now()
	if clientID == id {
		clientID = "" // the record's id says it
	}
	rec := &dispatcher.Record{
		ID: id, ClientID: clientID, State: dispatcher.StateQueued, Generation: 1, Model: in.req.Model, Pool: dispatcher.PoolName(in.req.Model),
		Endpoint: endpoint, Stream: in.req.Stream, Prompts: len(in.batch), Gateway: h.id, Owner: callerOf(c).owner,
		Created: now, Updated: now, Deadline: now.Add(h.cfg.RequestTimeout),
	}
	claim, err := h.submitter.Claim(c.Request().Context(), rec)
	if err != nil {
		h.unclaim(id, rec.Created, err)
		return nil, h.submitFailed(c, err, log)
	}
	return &batchRecord{claim: claim, rec: rec}, nil
}

// endBatch records how the batch ended: done once its answer went out
// whole, else as its first end said (a client gone, by default).
func (h *handlers) endBatch(c echo.Context, b *batchRecord, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if trackOf(c).whole {
		done := func(r *dispatcher.Record) error {
			if r.Gateway != b.rec.Gateway || r.Generation != b.rec.Generation {
				return dispatcher.ErrNoChange
			}
			r.State, r.Error = dispatcher.StateDone, nil
			return nil
		}
		if _, err := b.claim.Transition(ctx, h.records, done); err != nil {
			log.Debug("could not record the delivered answer yet; kept until NATS answers", logging.Err(err))
			h.ledger.Keep(b.rec.ID, b.rec.Created, done)
		}
		return
	}
	if c.Request().Context().Err() != nil {
		b.end(dispatcher.StateCancelled, 499, "client went away")
	}
	b.end(dispatcher.StateFailed, http.StatusBadGateway, "the batch ended without an answer")
	h.ledger.Write(ctx, b.rec.ID, b.rec.Created, func(r *dispatcher.Record) error {
		if r.Generation > b.rec.Generation || r.State.Ended() {
			return dispatcher.ErrNoChange
		}
		r.State, r.Error = b.state, b.err
		return nil
	}, log)
}
