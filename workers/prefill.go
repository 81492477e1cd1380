package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/nixl"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// prefill runs the prefill leg and returns the handoff for the decode
// stage; the stage loop stores it.
func (w *Worker) prefill(ctx context.Context, d *stage.Delivery) error {
	job := d.Job
	log := w.log.With(logging.KeyRequestID, job.ID)
	body, err := nixl.PrefillParts(job.Body)
	if err != nil {
		return badBody(err)
	}
	start := time.Now()
	// A hung engine must not hold the job: past the deadline the attempt
	// fails as retryable and the job moves on.
	cctx, cancel := context.WithTimeoutCause(ctx, w.cfg.PrefillTimeout, errTimedOut)
	defer cancel()
	told := w.tellPrefilled(d, log, start)
	defer told.close()
	raw, err := w.prefillCall(cctx, job, body)
	told.answered(err == nil, raw)
	var f *verdict.Failure
	switch {
	case err == nil:
	case ctx.Err() == nil && errors.Is(context.Cause(cctx), errTimedOut):
		return timedOut(dispatcher.StagePrefill, "prefill", w.cfg.PrefillTimeout)
	case ctx.Err() == nil && errors.As(err, &f) && f.Rejected && w.canForward():
		// The engine refused the prefill leg's body, whose numbers are not
		// the client's (one output token, say): the decode engine judges
		// the client's own body, so its refusal names the client's
		// max_tokens, and a request only the prefill engine refuses is
		// still served.
		if w.refusals.Add(1) == 1 {
			// Once per worker: a prefill engine that refuses everything
			// (set up unlike the decode engines) shows in the log, then in
			// pdq_decode_only_total{reason="prefill_refused"}.
			log.Warn("prefill engine refused a request: sent decode-only for the decode engine to judge (logged once)", logging.Err(err))
		} else {
			log.Debug("prefill engine refused the request: sent decode-only for the decode engine to judge", logging.Err(err))
		}
		w.cfg.Metrics.Shared().DecodeOnly("prefill_refused")
		d.Forward()
		return nil
	default:
		return err
	}
	params, err := nixl.ExtractKVParams(raw)
	if err != nil {
		if errors.Is(err, nixl.ErrNoKVParams) || errors.Is(err, nixl.ErrIncompleteKVParams) {
			w.cfg.Metrics.HandoffWithoutKV(job.Pool)
			log.Error("prefill engine answered 200 without usable kv_transfer_params; not falling back to a recomputing decode",
				logging.Err(err), "attempt", d.Attempt)
		}
		return verdict.Retryable(err, openai.NewError(http.StatusBadGateway, "prefill engine returned no usable kv_transfer_params"))
	}
	if fixed, ok := nixl.FixRemoteHost(params, w.kvHost); ok {
		params = fixed
		log.Debug("rewrote the loopback remote_host of the prefill engine", "remote_host", w.kvHost)
	}
	params, err = dispatcher.CompactKV(params)
	if err != nil {
		return verdict.Retryable(err, openai.NewError(http.StatusBadGateway, "prefill engine returned unreadable kv_transfer_params"))
	}
	elapsed := time.Since(start)
	told.ended()
	d.HandOff(params, dispatcher.StageRecord{
		Stage: dispatcher.StagePrefill, Generation: job.Generation, Worker: w.id, Engine: w.engine.URL(),
		Started: start, Ms: float64(elapsed.Microseconds()) / 1000,
	})
	log.Debug("prefill done", logging.Ms("prefill_ms", elapsed),
		logging.Ms("queued_ms", start.Sub(job.Submitted)))
	return nil
}

// tellPrefilled counts a prefill begun at start in the worker's clock,
// and tells the gateway of a job whose fair queue asked
// (Job.ReplyPrefilled) that it ended: prefillLead before the clock
// expects it to, or as it ended, whichever comes first. The engine is
// free then: the gateway lets the next request in, not a hand-off later,
// when the decode starts. Every prefill counts in the clock, told or not:
// one it did not count would run beside those it predicts.
func (w *Worker) tellPrefilled(d *stage.Delivery, log *slog.Logger, start time.Time) *prefilledTeller {
	p := &prefilledTeller{clock: &w.clock, timing: w.clock.begin(d.Job.PromptTokens, start)}
	if !d.Job.ReplyPrefilled {
		return p
	}
	replies := d.Replies() // made here: the timer's goroutine only uses it
	engine := dispatcher.EngineKey(w.engine.URL())
	p.tell = sync.OnceFunc(func() {
		if err := replies.Prefilled(engine); err != nil {
			log.Debug("the gateway was not told the prefill ended; it learns as the decode starts", logging.Err(err))
		}
	})
	if wait := p.timing.expect - prefillLead; wait > 0 {
		p.early = time.AfterFunc(wait, p.tell)
	}
	return p
}

// answerGrace is how long a prefill call whose context ended waits for
// an answer already on its way before it is aborted. An engine that has
// done the prefill holds the prompt's KV for the answer's params: dropped,
// the KV stays held for its lease (vLLM's NIXL abort timeout, 480 s by
// default); taken in, it is queued for release (see the stage loop's
// process). An engine still prefilling works that much longer for nobody.
const answerGrace = 100 * time.Millisecond

// prefillCall posts the prefill leg and reads its whole answer. When ctx
// ends, the call goes on for up to answerGrace: an answer that comes in
// that time is returned, and the caller learns from its context that the
// client has gone.
func (w *Worker) prefillCall(ctx context.Context, job *dispatcher.Job, body [][]byte) ([]byte, error) {
	if ctx.Err() != nil {
		return nil, ctx.Err() // no call for a client already gone
	}
	cctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	stop := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(answerGrace, func() { cancel(context.Cause(ctx)) })
		context.AfterFunc(cctx, func() { t.Stop() })
	})
	defer stop()
	resp, err := w.call(cctx, job, body...)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes))
	if err != nil {
		return nil, unreachable(cctx, dispatcher.StagePrefill, fmt.Errorf("read prefill response: %w", err))
	}
	return raw, nil
}
