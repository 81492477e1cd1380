package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// call sends one leg of a job to the engine. Both legs go through here, so
// both carry the job's id as X-Request-Id. It returns the response of a 200;
// any other answer, or none, comes back classified for the ack policy.
func (w *Worker) call(ctx context.Context, job *dispatcher.Job, body ...[]byte) (*http.Response, error) {
	resp, err := w.engine.Post(ctx, job.Endpoint, job.ID, body...)
	if err != nil {
		var op *net.OpError
		if errors.As(err, &op) && op.Op == "dial" {
			// No connection, so no request: the engine never saw it.
			err = &notRun{err: err}
		}
		return nil, unreachable(ctx, w.cfg.Role, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, engineFailure(w.cfg.Role, resp.StatusCode, raw, retryAfter(resp.Header.Get("Retry-After")))
	}
	return resp, nil
}

// notRun is an engine's failure that says it did not run the request: the
// connection was refused, or it answered 503 or 429, perhaps with a
// Retry-After. A decode engine so refused has not read the handoff's KV.
type notRun struct {
	err error
	// retryAfter is the engine's Retry-After, 0 when it sent none.
	retryAfter time.Duration
	// status is the engine's answer (503, 429); 0 for no connection.
	status int
}

// surely reports whether the engine surely did not run the call. A
// refused connection and a 429 say so. A 503 does on a streamed call,
// whose errors come in the stream once the engine has begun, or with a
// Retry-After; without one, on a call answered whole, it may be a proxy's
// "upstream reset" after the engine began, and so read a handoff's KV.
func (e *notRun) surely(streamed bool) bool {
	return e.status != http.StatusServiceUnavailable || streamed || e.retryAfter > 0
}

// neverRan reports whether a failed engine call was surely never run, so
// that a handoff's KV is unread: a refusal that says so (notRun), or, on a
// streamed call, any error status, since an engine answers a stream's
// errors in the stream once it has begun.
func neverRan(err error, streamed bool) bool {
	var refused *notRun
	if errors.As(err, &refused) && refused.surely(streamed) {
		return true
	}
	var fault *engineFault
	return streamed && errors.As(err, &fault) && fault.status != 0
}

func (e *notRun) Error() string { return e.err.Error() }
func (e *notRun) Unwrap() error { return e.err }

// retryAfter reads a Retry-After header: seconds, or an HTTP date; 0 when
// absent or unreadable.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if secs, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
		return time.Duration(max(secs, 0)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// engineFailure classifies a non-2xx engine answer: 429 and 5xx are
// transient, and retried; 401, 403 and 404 mean a worker set up wrong for
// its engine, and are retried on prefill but end a decode at once; any
// other 4xx is the client's and goes back to it with the engine's status
// and message.
func engineFailure(role dispatcher.Stage, status int, body []byte, wait time.Duration) error {
	apiErr, ok := openai.ParseError(body)
	if !ok {
		apiErr = openai.NewError(status, "%s engine answered %d: %s", role, status, truncate(string(body), 200))
	}
	err := fmt.Errorf("%s engine answered %d: %s", role, status, apiErr.Message)
	switch {
	case status == http.StatusTooManyRequests:
		return verdict.Retryable(&notRun{err: err, retryAfter: wait, status: status}, openai.NewError(http.StatusServiceUnavailable, "%s engine busy: %s", role, apiErr.Message))
	case status == http.StatusServiceUnavailable:
		return verdict.Retryable(&engineFault{err: &notRun{err: err, retryAfter: wait, status: status}, status: status},
			openai.NewError(http.StatusServiceUnavailable, "%s engine busy: %s", role, apiErr.Message))
	case status >= 500:
		return verdict.Retryable(&engineFault{err: err, status: status}, openai.NewError(http.StatusBadGateway, "%s engine failed: %s", role, apiErr.Message))
	case status == http.StatusUnauthorized || status == http.StatusForbidden || status == http.StatusNotFound:
		// Not the client's doing: the worker is set up wrong for its engine
		// (a key, a route, a model). A prefill is retried, then kept for
		// replay; a decode ends at once (a retry would prefill again), with
		// its KV released, since the engine refused before reading it.
		e := openai.NewError(http.StatusBadGateway, "%s engine refused pdq (%d): %s", role, status, apiErr.Message)
		if role == dispatcher.StageDecode {
			return verdict.Rejected(err, e)
		}
		return verdict.Retryable(err, e)
	case status >= 400:
		apiErr.Code, apiErr.Type = status, openai.ErrorType(status)
		return verdict.Rejected(err, apiErr)
	}
	return verdict.Retryable(err, openai.NewError(http.StatusBadGateway, "%s engine answered %d", role, status))
}

// errTimedOut is the cause of an engine call cut off by a role deadline.
var errTimedOut = errors.New("engine deadline passed")

// timedOut is the failure of an engine call that took longer than its
// role allows: retryable, on another engine if one is free.
func timedOut(role dispatcher.Stage, what string, limit time.Duration) error {
	return verdict.Retryable(&engineFault{err: fmt.Errorf("%s engine: %s: no answer within %v", role, what, limit)},
		openai.NewError(http.StatusGatewayTimeout, "%s engine did not answer within %v", role, limit))
}

// unreachable is the failure of an engine call that got no answer.
func unreachable(ctx context.Context, role dispatcher.Stage, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return verdict.Retryable(&engineFault{err: err, unreachable: true}, openai.NewError(http.StatusBadGateway, "%s engine unreachable", role))
}

// engineFault is an engine failure that counts against its health, for
// the breaker: no answer (unreachable), a 5xx, a stage time-out.
type engineFault struct {
	err         error
	unreachable bool
	// status is the engine's answer (a 5xx); 0 when there was none.
	status int
}

func (e *engineFault) Error() string { return e.err.Error() }
func (e *engineFault) Unwrap() error { return e.err }

var errBadEnvelope = errors.New("job body is not a JSON object")

// badBody is the failure of a job whose body cannot be built into an
// engine request: no attempt can fix it.
func badBody(err error) error {
	return verdict.Permanent(fmt.Errorf("%w: %w", errBadEnvelope, err), openai.NewError(http.StatusBadRequest, "request body: %v", err))
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
