package gateway

import (
	"errors"
	"io"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// byteBudget bounds the request bytes the gateway holds at once, so that
// many large requests (or clients that send one and leave) cannot run it
// out of memory: past the bound, a request gets a 429 instead. The reply
// bytes waiting for slow clients count too (dispatcher.Budget), taken and
// given back once per reply message: it is an atomic count, not a lock.
// What it holds is pdq_gateway_inflight_bytes.
//
// take and release are called by request handlers and relays; Take and
// Release by the reply queues, from the reply subscription's goroutine
// and, in pdq up, the workers' goroutines: any number at once.
type byteBudget struct {
	limit   int64 // set by newByteBudget
	used    atomic.Int64
	metrics *Metrics // set by newByteBudget; nil counts nothing
}

func newByteBudget(limit int64, metrics *Metrics) *byteBudget {
	return &byteBudget{limit: limit, metrics: metrics}
}

// take reserves n bytes if they fit. Two takes at once may each see the
// other's bytes and one fail that alone would fit: a bound, not a queue.
func (b *byteBudget) take(n int64) bool {
	if n == 0 {
		return true
	}
	if b.used.Add(n) > b.limit {
		b.used.Add(-n)
		return false
	}
	b.metrics.GatewayBytes(n)
	return true
}

// release returns n reserved bytes.
func (b *byteBudget) release(n int64) {
	if n != 0 {
		b.used.Add(-n)
		b.metrics.GatewayBytes(-n)
	}
}

// Take and Release are take and release for the reply queues
// (dispatcher.Budget).
func (b *byteBudget) Take(n int64) bool { return b.take(n) }
func (b *byteBudget) Release(n int64)   { b.release(n) }

// readBody reads at most the configured bytes of a request body, within
// the gateway's budget of bytes held at once: a body of known length is
// reserved before it is read, one of unknown length (chunked) as it is read.
// The caller must call the returned release when it no longer holds the
// body, error or not.
func (h *handlers) readBody(c echo.Context) ([]byte, func(), *openai.Error) {
	r := c.Request()
	in := &budgetReader{r: http.MaxBytesReader(c.Response(), r.Body, h.cfg.MaxBodyBytes), budget: h.budget}
	release := func() { h.budget.release(in.taken) }
	if n := r.ContentLength; n > 0 {
		if n > h.cfg.MaxBodyBytes {
			return nil, release, openai.NewError(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", h.cfg.MaxBodyBytes)
		}
		if !h.budget.take(n) {
			return nil, release, h.overBudget(c)
		}
		in.taken = n
	}
	// A body that stops coming must not hold the connection and its
	// reserved bytes: its read has a deadline, lifted once it is read
	// (the reply may stream for minutes).
	rc := http.NewResponseController(c.Response())
	if err := rc.SetReadDeadline(time.Now().Add(h.cfg.BodyTimeout)); err == nil {
		defer rc.SetReadDeadline(time.Time{})
	}
	body, err := readAll(in, r.ContentLength)
	if err != nil {
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			return nil, release, openai.NewError(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", tooBig.Limit)
		case errors.Is(err, errOverBudget):
			return nil, release, h.overBudget(c)
		case errors.Is(err, os.ErrDeadlineExceeded):
			c.Response().Header().Set("Connection", "close")
			return nil, release, openai.NewError(http.StatusRequestTimeout, "the request body did not arrive within %v", h.cfg.BodyTimeout)
		}
		return nil, release, openai.NewError(http.StatusBadRequest, "could not read the request body: %v", err)
	}
	return body, release, nil
}

// readAll is io.ReadAll sized by the request's Content-Length when it
// has one: a long prompt is read into one buffer, not grown into it
// through a dozen copies.
func readAll(r io.Reader, size int64) ([]byte, error) {
	if size <= 0 {
		return io.ReadAll(r)
	}
	b := make([]byte, 0, size+1) // +1: EOF is seen without growing
	for {
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // longer than announced: grow as ReadAll would
		}
	}
}

// errOverBudget ends the read of a body that does not fit the budget.
var errOverBudget = errors.New("over the gateway's in-flight byte budget")

// budgetReader takes budget for the bytes it reads beyond what was
// reserved up front.
type budgetReader struct {
	r      io.Reader
	budget *byteBudget
	taken  int64 // reserved so far, released by the caller
	read   int64
}

func (b *budgetReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.read += int64(n)
	if extra := b.read - b.taken; extra > 0 {
		// Reserve in steps of 64 KiB, not per read, to keep the lock cold;
		// near the limit, exactly what was read.
		switch step := max(extra, 64<<10); {
		case b.budget.take(step):
			b.taken += step
		case b.budget.take(extra):
			b.taken += extra
		default:
			return n, errOverBudget
		}
	}
	return n, err
}

// answerOverBudget is the error of a whole answer, come in parts, that the
// budget cannot hold as the gateway joins them: a 503, the engine's work
// done, with Retry-After.
func (h *handlers) answerOverBudget(c echo.Context) *openai.Error {
	c.Response().Header().Set("Retry-After", "1")
	return openai.NewError(http.StatusServiceUnavailable, "the gateway holds too many bytes to take this answer; retry")
}

func (h *handlers) overBudget(c echo.Context) *openai.Error {
	c.Response().Header().Set("Retry-After", "1")
	return openai.NewError(http.StatusTooManyRequests,
		"the gateway holds %d bytes of requests, its limit; retry shortly", h.cfg.MaxInflightBytes)
}
