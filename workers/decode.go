package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// decode runs the decode leg and relays its output to the gateway.
func (w *Worker) decode(ctx context.Context, d *dispatcher.Delivery) error {
	job := d.Job
	log := w.log.With(logging.KeyRequestID, job.ID)
	body, err := DecodeBody(job.Body, job.KV)
	if err == nil && job.ReplyTo == "" {
		// A replay has no client to stream to: its answer is kept whole in
		// the request record.
		body, err = OneResponse(body)
	}
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
	resp, err := w.call(ctx, job, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if job.Stream && job.ReplyTo != "" {
		err = w.relayStream(ctx, resp.Body, out)
	} else {
		err = relayBody(ctx, resp.Body, out)
	}
	if err != nil {
		return err
	}
	mode := "pd"
	if len(job.KV) == 0 {
		mode = "decode-only"
	}
	log.Debug("decode done", "mode", mode, "chunks", out.Sent(), logging.Ms("decode_ms", time.Since(start)),
		logging.Ms("total_ms", time.Since(job.Submitted)))
	return nil
}

// release frees the prefill engine's KV blocks of a handoff that will not
// be decoded: a decode call for one token whose output is dropped. The
// decode engine reads the blocks, which tells the prefill engine to free
// them, as any read does.
func (w *Worker) release(ctx context.Context, job *dispatcher.Job) error {
	body, err := ReleaseBody(job.Body, job.KV)
	if err != nil {
		return err
	}
	resp, err := w.engine.Post(ctx, job.Endpoint, job.ID, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, maxResponseBytes))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("decode engine answered %d to the release call", resp.StatusCode)
	}
	return nil
}

// relayStream forwards each SSE event as a chunk and ends on [DONE]. A
// stream that breaks before any event is retried; one that breaks later
// cannot be, since the client has part of it, and ends with an error.
func (w *Worker) relayStream(ctx context.Context, body io.Reader, out *dispatcher.ReplyWriter) error {
	events := openai.NewSSEReader(body)
	for {
		ev, err := events.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF // ended without [DONE]
			}
			err = fmt.Errorf("decode stream broke after %d events: %w", out.Sent(), err)
			if out.Sent() == 0 {
				return unreachable(ctx, dispatcher.StageDecode, err)
			}
			if rerr := out.Error(openai.NewError(http.StatusBadGateway, "the decode engine's stream broke off")); rerr != nil {
				w.log.Warn("could not send the error to the gateway", logging.Err(rerr))
			}
			return dispatcher.Reported(err)
		}
		if ev.IsDone() {
			return out.Done()
		}
		if err := out.Chunk(ev.Data); err != nil {
			return dispatcher.Retryable(err, nil)
		}
	}
}

// relayBody forwards a non-streamed response as one chunk.
func relayBody(ctx context.Context, body io.Reader, out *dispatcher.ReplyWriter) error {
	raw, err := io.ReadAll(io.LimitReader(body, maxResponseBytes))
	if err != nil {
		return unreachable(ctx, dispatcher.StageDecode, fmt.Errorf("read decode response: %w", err))
	}
	if err := out.Chunk(raw); err != nil {
		return dispatcher.Retryable(err, nil)
	}
	return out.Done()
}
