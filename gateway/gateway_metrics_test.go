package gateway

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// TestInflightBytesGauge: pdq_gateway_inflight_bytes is what the byte
// budget holds: a take that does not fit adds nothing, and what is given
// back leaves it.
func TestInflightBytesGauge(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := newByteBudget(1000, m)
	if !b.take(600) || !b.Take(300) {
		t.Fatal("900 bytes of a 1000-byte budget did not fit")
	}
	if b.take(200) {
		t.Fatal("1100 bytes of a 1000-byte budget fit")
	}
	if got := dispatchertest.Value(t, reg, "pdq_gateway_inflight_bytes"); got != 900 {
		t.Errorf("900 bytes held: pdq_gateway_inflight_bytes = %v", got)
	}
	b.release(600)
	b.Release(300)
	if got := dispatchertest.Value(t, reg, "pdq_gateway_inflight_bytes"); got != 0 {
		t.Errorf("all given back: pdq_gateway_inflight_bytes = %v", got)
	}
}

// TestInflightRequestsGauge: a generation request counts in
// pdq_gateway_inflight_requests while the gateway holds it, a 401 too.
func TestInflightRequestsGauge(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &handlers{Server: &Server{cfg: Config{Counters: m}}}
	var during float64
	handler := h.track(func(c echo.Context) error {
		during = dispatchertest.Value(t, reg, "pdq_gateway_inflight_requests")
		return c.NoContent(http.StatusUnauthorized)
	})
	e := echo.New()
	c := e.NewContext(httptest.NewRequest(http.MethodPost, "/v1/completions", nil), httptest.NewRecorder())
	if err := handler(c); err != nil {
		t.Fatal(err)
	}
	if during != 1 {
		t.Errorf("while a request runs: pdq_gateway_inflight_requests = %v, want 1", during)
	}
	if got := dispatchertest.Value(t, reg, "pdq_gateway_inflight_requests"); got != 0 {
		t.Errorf("once it is answered: pdq_gateway_inflight_requests = %v, want 0", got)
	}
}

// TestGatewayGauges: the requests and bytes a gateway holds go up and back
// down to zero.
func TestGatewayGauges(t *testing.T) {
	m, err := NewMetrics(prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	one, two := m.GatewayRequest(), m.GatewayRequest()
	m.GatewayBytes(1000)
	m.GatewayBytes(24)
	if r, b := testutil.ToFloat64(m.gatewayRequests), testutil.ToFloat64(m.gatewayBytes); r != 2 || b != 1024 {
		t.Errorf("two requests of 1024 bytes held: pdq_gateway_inflight_requests = %v, _bytes = %v", r, b)
	}
	one()
	two()
	m.GatewayBytes(-1024)
	if r, b := testutil.ToFloat64(m.gatewayRequests), testutil.ToFloat64(m.gatewayBytes); r != 0 || b != 0 {
		t.Errorf("all given back: pdq_gateway_inflight_requests = %v, _bytes = %v", r, b)
	}
	var none *Metrics
	none.GatewayRequest()()
	none.GatewayBytes(1)
}
