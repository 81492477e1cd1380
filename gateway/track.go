package gateway

import (
	"net/http"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
)

// tracked is what the gateway measures of one request, for /metrics.
type tracked struct {
	arrived, first, last time.Time
	model                string
	itl                  prometheus.Observer // looked up at the first write
	whole                bool                // the answer went out whole
	failed               bool                // the request failed after its status was sent
	// onFirst, when set, is called at the first write.
	onFirst func()
}

const trackedKey = "pdq.tracked"

// trackOf is the request's tracked, or a throwaway one.
func trackOf(c echo.Context) *tracked {
	if t, ok := c.Get(trackedKey).(*tracked); ok {
		return t
	}
	return &tracked{}
}

// wrote notes a write of answer to the client: the first is the time to
// first token, the others the gaps between tokens.
func (t *tracked) wrote(m *Metrics) {
	now := time.Now()
	if t.first.IsZero() {
		t.first, t.itl = now, m.ITL(t.model)
		if t.onFirst != nil {
			t.onFirst()
		}
	} else if t.itl != nil {
		t.itl.Observe(now.Sub(t.last).Seconds())
	}
	t.last = now
}

// track measures a generation request for /metrics, from its arrival
// (before the key check, so that a 401 counts too) to its answer.
func (h *handlers) track(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		t := &tracked{arrived: time.Now(), model: "unknown"}
		c.Set(trackedKey, t)
		defer h.account(c, t)
		defer h.cfg.Counters.GatewayRequest()() // in flight until answered
		return next(c)
	}
}

// account counts a request once it is answered, by its outcome.
func (h *handlers) account(c echo.Context, t *tracked) {
	status := c.Response().Status
	outcome := "error"
	switch {
	case t.whole:
		outcome = "ok"
	case c.Request().Context().Err() != nil:
		outcome = "cancelled"
	case t.failed || status >= 500 && status != http.StatusServiceUnavailable:
		outcome = "error"
	case status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable:
		outcome = "rejected"
	case status >= 400:
		outcome = "client_error"
	}
	var ttft, e2e time.Duration
	if !t.first.IsZero() {
		ttft = t.first.Sub(t.arrived)
	}
	if t.whole {
		e2e = time.Since(t.arrived)
	}
	h.cfg.Counters.Request(t.model, outcome, ttft, e2e)
}
