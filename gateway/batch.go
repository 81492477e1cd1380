package gateway

import (
	"bytes"
	"context"
	"encoding/json"
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
	return h.relay(c, jobs, newBatchMerge(openai.Completions.IDPrefix()+clientID, n), parent, in.req.Stream, log)
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
			h.ledger.keep(b.rec.ID, b.rec.Created, done)
		}
		return
	}
	if c.Request().Context().Err() != nil {
		b.end(dispatcher.StateCancelled, 499, "client went away")
	}
	b.end(dispatcher.StateFailed, http.StatusBadGateway, "the batch ended without an answer")
	h.ledger.write(ctx, b.rec.ID, b.rec.Created, func(r *dispatcher.Record) error {
		if r.Generation > b.rec.Generation || r.State.Ended() {
			return dispatcher.ErrNoChange
		}
		r.State, r.Error = b.state, b.err
		return nil
	}, log)
}

// batchMerge rewrites the answers of a batch's jobs into one.
type batchMerge struct {
	id []byte // the batch's response id, as JSON
	n  int    // choices per prompt
	// usage is the last usage-only chunk of the streams, held back to be
	// summed into one.
	usage []byte
	sum   openai.Usage
}

func newBatchMerge(id string, n int) *batchMerge {
	return &batchMerge{id: jsonobj.AppendString(nil, id), n: n}
}

// addUsage adds the counts of a usage object to the batch's sum.
func (m *batchMerge) addUsage(raw json.RawMessage) error {
	var v openai.Usage
	if err := json.Unmarshal(raw, &v); err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	m.sum.PromptTokens += v.PromptTokens
	m.sum.TotalTokens += v.TotalTokens
	m.sum.CompletionTokens += v.CompletionTokens
	return nil
}

// chunk rewrites a stream chunk of prompt i: the batch's id, and the
// choices' indexes. A usage-only chunk (the end of a stream asked with
// include_usage) is held back (held), to be summed into one.
func (m *batchMerge) chunk(i int, data []byte) (out []byte, held bool, err error) {
	v, err := jsonobj.Lookup(data, "choices", "usage")
	if err != nil {
		return nil, false, fmt.Errorf("a chunk of prompt %d is not JSON: %w", i, err)
	}
	choices, usage := v[0], v[1]
	if none(choices) && !isNull(usage) {
		if err := m.addUsage(usage); err != nil {
			return nil, false, err
		}
		m.usage = data
		return nil, true, nil
	}
	return m.rewrite(i, data, choices)
}

// rewrite sets a response's or chunk's id to the batch's, and its choices'
// indexes to their place in the batch.
func (m *batchMerge) rewrite(i int, data, choices []byte) ([]byte, bool, error) {
	ops := []jsonobj.Op{jsonobj.Set("id", m.id)}
	if !none(choices) {
		list, err := m.reindex(nil, i, choices)
		if err != nil {
			return nil, false, err
		}
		ops = append(ops, jsonobj.Set("choices", array(list)))
	}
	out, err := jsonobj.Edit(data, ops...)
	return out, false, err
}

// reindex renumbers prompt i's choices, a JSON array, choice j becoming
// i*n+j, and appends them to list, a JSON array's members.
func (m *batchMerge) reindex(list []byte, i int, choices []byte) ([]byte, error) {
	err := jsonobj.LookupEach(choices, []string{"index"}, func(_ int, ch []byte, v []json.RawMessage, _ []int) error {
		var index int
		if v[0] != nil {
			if err := json.Unmarshal(v[0], &index); err != nil {
				return err
			}
		}
		ch, err := jsonobj.Edit(ch, jsonobj.Set("index", strconv.AppendInt(nil, int64(i*m.n+index), 10)))
		if err != nil {
			return err
		}
		if len(list) > 0 {
			list = append(list, ',')
		}
		list = append(list, ch...)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("the choices of prompt %d: %w", i, err)
	}
	return list, nil
}

// none reports whether a choices member is absent, null or empty.
func none(choices []byte) bool {
	return isNull(choices) || choices[0] == '[' && len(bytes.TrimSpace(choices[1:len(choices)-1])) == 0
}

// isNull reports whether a member is absent or null.
func isNull(v []byte) bool { return v == nil || string(v) == "null" }

// tail is the one usage chunk of a merged stream, or nil when the
// streams sent none.
func (m *batchMerge) tail() []byte {
	if m.usage == nil {
		return nil
	}
	out, err := jsonobj.Edit(m.usage, jsonobj.Set("id", m.id))
	if err == nil {
		out, err = m.withUsage(out)
	}
	if err != nil {
		return m.usage
	}
	return out
}

// withUsage puts the summed usage into obj's usage object, keeping the
// object's other fields (prompt_tokens_details, ...).
func (m *batchMerge) withUsage(obj []byte) ([]byte, error) {
	usage, _, err := jsonobj.Get(obj, "usage")
	if err != nil {
		return nil, err
	}
	if isNull(usage) {
		return obj, nil
	}
	num := func(n int) []byte { return strconv.AppendInt(nil, int64(n), 10) }
	u, err := jsonobj.Edit(usage, jsonobj.Set("prompt_tokens", num(m.sum.PromptTokens)),
		jsonobj.Set("total_tokens", num(m.sum.TotalTokens)), jsonobj.Set("completion_tokens", num(m.sum.CompletionTokens)))
	if err != nil {
		return nil, err
	}
	return jsonobj.Edit(obj, jsonobj.Set("usage", u))
}

// whole merges the non-streamed responses of a batch: the first
// prompt's response, with the batch's id, every prompt's choices, and the
// usage summed.
func (m *batchMerge) whole(parts [][]byte) ([]byte, error) {
	var list []byte
	for i, data := range parts {
		v, err := jsonobj.Lookup(data, "choices", "usage")
		if err != nil {
			return nil, fmt.Errorf("the response of prompt %d: %w", i, err)
		}
		if !isNull(v[1]) {
			if err := m.addUsage(v[1]); err != nil {
				return nil, err
			}
		}
		if !none(v[0]) {
			if list, err = m.reindex(list, i, v[0]); err != nil {
				return nil, err
			}
		}
	}
	out, err := jsonobj.Edit(parts[0], jsonobj.Set("id", m.id), jsonobj.Set("choices", array(list)))
	if err == nil {
		out, err = m.withUsage(out)
	}
	return out, err
}

// array wraps a list's members in brackets.
func array(members []byte) []byte {
	out := make([]byte, 0, len(members)+2)
	out = append(out, '[')
	out = append(out, members...)
	return append(out, ']')
}
