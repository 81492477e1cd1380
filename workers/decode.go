package workers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/nixl"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// decode runs the decode leg and relays its output to the gateway.
func (w *Worker) decode(ctx context.Context, d *stage.Delivery) error {
	job := d.Job
	log := w.log.With(logging.KeyRequestID, job.ID)
	// A replay has no client to stream to: its answer is kept whole in the
	// request record.
	client, err := continued(job)
	if err != nil {
		return badBody(err)
	}
	body, err := nixl.DecodeParts(client, job.KV, job.ReplyTo == "")
	if err != nil {
		return badBody(err)
	}
	start := time.Now()
	out := d.Replies()
	stage := dispatcher.StageRecord{Stage: dispatcher.StageDecode, Generation: job.Generation, Worker: w.id,
		Engine: w.engine.URL(), Started: start}
	if job.Prefill != nil {
		out.SetStages(*job.Prefill, stage)
	} else {
		out.SetStages(stage)
	}
	// The engine's silence is bounded, to its first chunk and between
	// chunks: a hung engine must not hold the request.
	streamed := job.Stream && job.ReplyTo != ""
	limit := w.cfg.StallTimeout
	if !streamed {
		limit = wholeAnswerLimit(job.Endpoint, job.Body, limit)
	}
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	watchdog := time.AfterFunc(limit, func() { cancel(errTimedOut) })
	defer watchdog.Stop()
	var tr *transcript // what was relayed, to go on from if the engine fails
	if streamed && w.cfg.MigrationLimit > 0 {
		tr = &transcript{}
	}
	var cont *continuation
	if job.Resume != nil {
		cont = &continuation{resume: *job.Resume, chat: job.Endpoint == openai.Chat}
	}
	events := eventHooks{
		each: func(data []byte) []byte {
			watchdog.Reset(limit)
			if cont != nil {
				return cont.rewrite(data)
			}
			return data
		},
		// Only what was sent to the gateway (over NATS, or into its queue
		// in pdq up) is in the transcript: a continuation must not skip
		// text the client never got.
		sent: func(data []byte) {
			if tr != nil {
				tr.add(data)
			}
		},
	}
	err = w.relay(cctx, job, body, out, streamed, func() { watchdog.Reset(limit) }, events)
	if err != nil && ctx.Err() == nil && errors.Is(context.Cause(cctx), errTimedOut) {
		err = timedOut(dispatcher.StageDecode, "silent", limit)
	}
	if err != nil {
		if out.Own() > 0 && ctx.Err() == nil {
			return w.brokeAfterOutput(ctx, d, out, tr, err)
		}
		return err
	}
	if err := out.Done(); err != nil {
		// The answer went out; the gateway did not confirm its end in
		// time. Its stall timer answers the client if the end was lost.
		log.Warn("the gateway did not acknowledge the end of the reply", logging.Err(err))
	}
	mode := "pd"
	if len(job.KV) == 0 {
		mode = "decode-only"
	}
	log.Debug("decode done", "mode", mode, "chunks", out.Sent(), logging.Ms("decode_ms", time.Since(start)),
		logging.Ms("total_ms", time.Since(job.Submitted)))
	return nil
}

// relay posts the decode leg and sends its output to the gateway, calling
// alive at each sign of progress from the engine.
func (w *Worker) relay(ctx context.Context, job *dispatcher.Job, body [][]byte, out *reply.Writer, streamed bool,
	alive func(), events eventHooks) error {
	resp, err := w.callDecode(ctx, job, body, streamed, alive)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	alive()
	if streamed {
		return relayStream(ctx, resp.Body, out, events, job.ReplyBatch)
	}
	return relayBody(ctx, resp.Body, out)
}

// callDecode posts the decode leg. A handoff whose call the engine surely
// did not run (it refused the connection, answered 429, or 503 where that
// is sure: see notRun) has not read its KV, and a new prefill would cost
// a GPU's prefill for a blip: while another decode worker of the model
// has a healthy engine, the handoff goes back to the queue for it (twice
// at most, and not for a 429: when every engine is busy, a handoff that
// bounced from one to the next would find none); otherwise the worker
// calls its engine again with back-off, as long as the engine asks
// (Retry-After), within the handoff's KV TTL. Past that, or on any other
// failure, the error goes to the stage loop: a streamed call answered
// with an error status never ran either (vLLM answers a stream's errors
// in the stream once it has begun), and is marked so, for its KV to be
// released.
func (w *Worker) callDecode(ctx context.Context, job *dispatcher.Job, body [][]byte, streamed bool, alive func()) (*http.Response, error) {
	var b *backoff.ExponentialBackOff // made only for an engine that refuses
	for waited := 0; ; waited++ {
		resp, err := w.call(ctx, job, body...)
		var refused *notRun
		switch {
		case err == nil || len(job.KV) == 0:
			return resp, err
		case !errors.As(err, &refused) || !refused.surely(streamed):
			if neverRan(err, streamed) {
				return nil, verdict.Unread(err)
			}
			return nil, err
		case refused.status != http.StatusTooManyRequests && job.HandBacks < blipHandBacks && w.healthyPeer(job.Model, w.engine.URL()):
			return nil, verdict.Unread(verdict.HandBack(err, openai.NewError(http.StatusServiceUnavailable, "decode engine unavailable")))
		}
		if b == nil {
			b = backoff.NewExponentialBackOff()
			b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 100*time.Millisecond, time.Second, 0
		}
		wait := max(b.NextBackOff(), refused.retryAfter)
		if job.Prefill == nil || time.Until(job.Prefill.Ended().Add(w.cfg.KVTTL)) < wait {
			w.log.Warn("decode engine did not take the handoff within its KV TTL; sending it back to prefill",
				logging.KeyRequestID, job.ID, logging.Err(err), "tries", waited+1)
			return nil, verdict.Unread(err)
		}
		if waited == 0 {
			w.log.Debug("decode engine did not take the handoff; waiting for it with the KV", logging.KeyRequestID, job.ID,
				logging.Err(err), "kv_ttl", w.cfg.KVTTL.String())
		}
		// The engine's silence is not what the stall watchdog times.
		alive()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			// Its client gone, or its deadline passed, while it waited:
			// its engine never ran it, so its KV is released.
			t.Stop()
			return nil, verdict.Unread(ctx.Err())
		case <-t.C:
		}
		alive()
	}
}

// blipHandBacks bounds the hand-backs of a handoff whose decode engine
// did not take it, so that it waits for an engine rather than bounce
// between busy ones.
const blipHandBacks = 2

// brokeAfterOutput handles a decode that failed after part of the answer
// went out. Nothing can start over; the rest of the answer moves to
// another decode engine (a migration) within PDQ_MIGRATION_LIMIT, and
// otherwise the client gets an in-stream error.
func (w *Worker) brokeAfterOutput(ctx context.Context, d *stage.Delivery, out *reply.Writer, tr *transcript, err error) error {
	job := d.Job
	log := w.log.With(logging.KeyRequestID, job.ID)
	resume := dispatcher.Resume{}
	if job.Resume != nil {
		resume = *job.Resume
	}
	if tr != nil {
		tr.read()
	}
	why := w.migration(job, resume, tr)
	if why == nil && tr.finished {
		// The answer is whole; only its end was lost.
		if derr := out.Done(); derr != nil {
			log.Warn("the gateway did not acknowledge the end of the reply", logging.Err(derr))
		}
		return nil
	}
	var sent []byte
	if why == nil {
		// The next decode builds the continuation from the client's body
		// and the text sent: it must build.
		sent = append(slices.Clip(job.Sent), tr.text.String()...)
		_, why = ContinueBody(job.Endpoint, job.Body, string(sent), resume.Tokens+tr.tokens)
	}
	if why == nil {
		// The gateway must have every chunk sent so far before another
		// engine numbers the next ones.
		why = out.Moved()
	}
	if why != nil {
		log.Warn("decode failed after output and cannot move to another engine", logging.Err(err), "why", why.Error())
		if rerr := out.Error(openai.NewError(http.StatusBadGateway, "the decode engine's stream broke off")); rerr != nil {
			log.Warn("could not send the error to the gateway", logging.Err(rerr))
		}
		return verdict.Reported(err)
	}
	if resume.Created == 0 {
		resume.Created = tr.created
	}
	resume.Chunks, resume.Tokens, resume.Migrations = out.Sent(), resume.Tokens+tr.tokens, resume.Migrations+1
	resume.Avoid, resume.AvoidUntil = w.engine.URL(), time.Now().Add(avoidFor).UnixMilli()
	d.Migrate(sent, resume, err)
	log.Debug("decode failed after output; moving it", logging.Err(err), "tokens_sent", resume.Tokens)
	return nil
}

// continued is the body a decode sends its engine, but for the handoff's
// params: the client's, or for a migrated decode, its continuation from
// the text sent. A continuation stored by an older pdq carries it built.
func continued(job *dispatcher.Job) ([]byte, error) {
	if job.Resume == nil || !job.Resume.Original {
		return job.Body, nil
	}
	return ContinueBody(job.Endpoint, job.Body, string(job.Sent), job.Resume.Tokens)
}

// migration says why a decode that failed after output cannot move, or
// nil.
func (w *Worker) migration(job *dispatcher.Job, resume dispatcher.Resume, tr *transcript) error {
	switch {
	case job.Resume != nil && !job.Resume.Original:
		return fmt.Errorf("%w: a continuation stored by an older pdq", errNotContinuable)
	case tr == nil:
		return fmt.Errorf("%w: migration is off (PDQ_MIGRATION_LIMIT=0) or the reply is not streamed", errNotContinuable)
	case tr.opaque:
		return fmt.Errorf("%w: the output held tool calls or reasoning, not only text", errNotContinuable)
	case tr.tooLong:
		return fmt.Errorf("%w: its text is over %d bytes", errNotContinuable, maxTranscriptText)
	case resume.Migrations >= w.cfg.MigrationLimit:
		return fmt.Errorf("%w: it moved %d times (PDQ_MIGRATION_LIMIT)", errNotContinuable, resume.Migrations)
	}
	return continuable(job.Endpoint, job.Body)
}

// wholeAnswerLimit bounds the wait for a response that comes whole (a
// non-streamed one): there are no chunks to time, so the stall time-out is
// stretched by 50 ms per requested token, a slow decode's pace. The token
// limit is read as vLLM reads it (openai.OutputLimitOf). Without a token
// limit the request's deadline alone bounds it.
func wholeAnswerLimit(endpoint openai.Endpoint, body []byte, stall time.Duration) time.Duration {
	n, ok, err := openai.OutputLimitOf(endpoint, body)
	switch {
	case err != nil:
		return stall
	case !ok:
		return 24 * time.Hour
	}
	return stall + time.Duration(max(n, 0))*50*time.Millisecond
}

// release frees the prefill engine's KV blocks of a handoff that will not
// be decoded: a streamed decode call for one token whose output is
// dropped. The decode engine reads the blocks, which tells the prefill
// engine to free them, as any read does. A call the engine did not run
// (no connection, or an error status: the stream never began) is marked
// dispatcher.Unread: the blocks are still held, and may be released later.
func (w *Worker) release(ctx context.Context, job *dispatcher.Job) error {
	body, err := nixl.ReleaseBody(job.Body, job.KV)
	if err != nil {
		return err
	}
	resp, err := w.call(ctx, job, body)
	switch {
	case err == nil:
	case neverRan(err, true):
		return verdict.Unread(fmt.Errorf("release call: %w", err))
	default:
		// A 4xx, which a retry would meet again, or a call cut off.
		return fmt.Errorf("release call: %w", err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, io.LimitReader(resp.Body, maxResponseBytes)); err != nil {
		return fmt.Errorf("release call: reading its stream: %w", err)
	}
	return nil
}

// eventHooks see a streamed decode's events: each returns the chunk to
// send for an event (nil: none), and sent is told of each event whose
// chunk went out.
type eventHooks struct {
	each func(data []byte) []byte
	sent func(data []byte)
}

// relayStream forwards each SSE event as a chunk, as the hooks make it, and
// ends on [DONE]. A stream that breaks before any event is retried; one
// that breaks later is the caller's to end. With batch set (the gateway
// reads batched replies), the events the engine has already sent are
// forwarded together, in one message: one publish per burst, not one per
// token; an event is never held back waiting for the next. An event whose
// data spans lines (joined by newlines) goes out on its own.
func relayStream(ctx context.Context, body io.Reader, out *reply.Writer, hooks eventHooks, batch bool) error {
	events := openai.NewSSEReader(body)
	var held, raw [][]byte // the chunks not sent yet, and their events
	size := 0
	flush := func() error {
		if len(held) == 0 {
			return nil
		}
		if err := out.Chunks(held); err != nil {
			return verdict.Retryable(err, nil)
		}
		for _, ev := range raw {
			hooks.sent(ev)
		}
		held, raw, size = held[:0], raw[:0], 0
		return nil
	}
	for {
		ev, err := events.Next()
		if err != nil {
			if ferr := flush(); ferr != nil {
				return ferr
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF // ended without [DONE]
			}
			err = fmt.Errorf("decode stream broke after %d events: %w", out.Sent(), err)
			return unreachable(ctx, dispatcher.StageDecode, err)
		}
		if ev.IsDone() {
			return flush()
		}
		if data := hooks.each(ev.Data); data != nil {
			switch {
			case batch && bytes.IndexByte(data, '\n') < 0:
				if size+len(data) > maxBatchBytes {
					if err := flush(); err != nil {
						return err
					}
				}
				held, raw, size = append(held, data), append(raw, ev.Data), size+len(data)
			default:
				if err := flush(); err != nil {
					return err
				}
				if err := out.Chunk(data); err != nil {
					return verdict.Retryable(err, nil)
				}
				hooks.sent(ev.Data)
			}
		}
		if len(held) > 0 && (len(held) >= maxBatchChunks || size >= maxBatchBytes || !events.HasEvent()) {
			if err := flush(); err != nil {
				return err
			}
		}
	}
}

// A batch of chunks is bounded in count and bytes, well within a NATS
// message.
const (
	maxBatchChunks = 64
	maxBatchBytes  = 256 << 10
)

// relayBody forwards a non-streamed response whole (in parts if it is
// larger than a message). One over maxResponseBytes is an error that says
// so: a retry would meet it again.
func relayBody(ctx context.Context, body io.Reader, out *reply.Writer) error {
	raw, err := io.ReadAll(io.LimitReader(body, maxResponseBytes+1))
	if err != nil {
		return unreachable(ctx, dispatcher.StageDecode, fmt.Errorf("read decode response: %w", err))
	}
	if len(raw) > maxResponseBytes {
		return verdict.Permanent(fmt.Errorf("the decode engine's answer is larger than %d bytes", maxResponseBytes),
			openai.NewError(http.StatusBadGateway, "the answer is larger than %d MiB, the most pdq relays whole; stream it instead", maxResponseBytes>>20))
	}
	if err := out.Whole(raw); err != nil {
		return verdict.Retryable(err, nil)
	}
	return nil
}
