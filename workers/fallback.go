package workers

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// observed runs a handler and tells the breaker how the engine did. A
// prefill worker whose breaker is open forwards jobs decode-only while no
// other prefill worker of its pool is healthy, instead of failing them.
func (w *Worker) observed(h stage.Handler) stage.Handler {
	return func(ctx context.Context, d *stage.Delivery) error {
		tok := d.Permit()
		if !w.breaker.admits(tok) {
			switch {
			case !w.alone(d.Job.Model):
				// A pull on its way when the breaker opened (or a pull
				// other than a half-open breaker's trial): another worker's
				// engine is healthy, so the job goes back without touching
				// this one.
				return verdict.HandBack(errHandedBack,
					openai.NewError(http.StatusServiceUnavailable, "%s engine unavailable", w.cfg.Role))
			case w.canForward():
				w.forward(d)
				return nil
			}
		}
		if w.avoids(d.Job) {
			w.breaker.neutral(tok)
			return verdict.HandBack(errAvoided,
				openai.NewError(http.StatusServiceUnavailable, "%s engine unavailable", w.cfg.Role))
		}
		err := h(ctx, d)
		var fault *engineFault
		switch {
		case err == nil && d.Moved() && errors.As(d.MovedFrom(), &fault):
			// The engine failed mid-stream (not, say, NATS refusing a
			// chunk): the handler moved the rest elsewhere.
			w.breaker.failed(ctx, tok, fault.unreachable, d.MovedFrom())
		case err == nil && d.Moved():
			w.breaker.neutral(tok)
		case err == nil:
			w.breaker.succeeded(tok)
		case errors.As(err, &fault) && ctx.Err() == nil:
			w.breaker.failed(ctx, tok, fault.unreachable, err)
		default:
			w.breaker.neutral(tok)
		}
		var f *verdict.Failure
		if err != nil && ctx.Err() == nil && errors.As(err, &f) && !f.Permanent && w.breaker.Open() && w.alone(d.Job.Model) && w.canForward() {
			w.forward(d)
			return nil
		}
		return err
	}
}

// alone reports whether no other worker of this stage serves the model
// with a healthy engine. A worker whose breaker is open stops pulling only
// when another can take the work: alone, it keeps pulling, and a prefill
// worker forwards its jobs decode-only (PDQ_PREFILL_FALLBACK=decode) while
// any other job runs on the sick engine and fails on its own, through the
// retries to its client, instead of waiting for its deadline in the queue.
// Each change is logged once.
func (w *Worker) alone(model string) bool {
	if w.peers == nil {
		return false
	}
	ok := !w.healthyPeer(model, "")
	w.mu.Lock()
	was, seen := w.lonely[model]
	w.lonely[model] = ok
	w.mu.Unlock()
	if (!seen || was != ok) && w.breaker.Open() {
		if ok {
			w.log.Warn("engine failing and no other healthy "+string(w.cfg.Role)+" worker: pulling on", "model", model, "forward_decode_only", w.canForward())
		} else {
			w.log.Info("another "+string(w.cfg.Role)+" worker is healthy: this one waits for its engine", "model", model)
		}
	}
	return ok
}

// A continuation is handed on from the engine it broke on at most
// avoidHandBacks times, and for avoidFor after the break: past either it
// runs there rather than wait longer. Each hand-back queues it anew,
// behind any backlog, and a healthy worker whose slots are all busy has
// no pull to take it.
const (
	avoidHandBacks = 6
	avoidFor       = 5 * time.Second
)

// avoids reports whether job is the continuation of a decode that broke
// on this worker's engine, while another worker of its model has a
// healthy engine. Here it would likely break again, past the migration
// limit, and end in an error: Dynamo keeps such a worker out of a
// migration's choice for a while; pdq's workers pull, so this one hands
// the continuation on. The hand-back goes to the oldest waiting pull,
// which is rarely this worker's own: it pulled again as the job came.
func (w *Worker) avoids(job *dispatcher.Job) bool {
	r := job.Resume
	return r != nil && r.Avoid == w.engine.URL() && time.Now().UnixMilli() < r.AvoidUntil &&
		job.HandBacks < avoidHandBacks && w.healthyPeer(job.Model, w.engine.URL())
}

// healthyPeer reports whether another worker of this stage serves model
// with a healthy engine other than engine ("": any).
func (w *Worker) healthyPeer(model, engine string) bool {
	if w.peers == nil {
		return false
	}
	for _, p := range w.peers.Workers() {
		if p.Role == w.cfg.Role && p.WorkerID() != w.id && p.Model == model && p.Healthy() && (engine == "" || p.Engine != engine) {
			return true
		}
	}
	return false
}

// errAvoided is the failure of a continuation handed on from the engine
// it broke on.
var errAvoided = errors.New("the decode broke on this engine: continuation handed on to another")

// errHandedBack is the failure of a job pulled as the worker's breaker
// opened: it never reached the engine.
var errHandedBack = errors.New("engine failing (breaker open): job handed back to the queue")

// canForward reports whether this worker sends its jobs on decode-only
// when its engine is down and it is alone: a prefill worker with the
// fallback on.
func (w *Worker) canForward() bool {
	return w.cfg.Role == dispatcher.StagePrefill && w.cfg.PrefillFallback != config.FallbackFail
}

// forward sends a job on to decode-only.
func (w *Worker) forward(d *stage.Delivery) {
	d.Forward()
	w.cfg.Metrics.Shared().Fallback(d.Job.Pool, "prefill")
	w.cfg.Metrics.Shared().DecodeOnly("no_healthy_prefill")
	w.log.Debug("prefill engine down: forwarded decode-only", logging.KeyRequestID, d.Job.ID)
}
