package gateway

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdq-dev/pdq/dispatcher"
)

// Metrics are the gateway's series: its requests, their latencies, and
// its load. A nil *Metrics counts nothing.
type Metrics struct {
	// shared are the counters the workers keep too.
	shared   *dispatcher.Metrics
	requests *prometheus.CounterVec
	ttft     *prometheus.HistogramVec
	itl      *prometheus.HistogramVec
	e2e      *prometheus.HistogramVec
	// The gateway's load: generation requests it holds and the bytes its
	// byte budget counts (PDQ_MAX_INFLIGHT_BYTES).
	gatewayRequests prometheus.Gauge
	gatewayBytes    prometheus.Gauge
}

// NewMetrics registers the gateway's series with reg; shared are the
// counters the workers keep too.
func NewMetrics(reg prometheus.Registerer, shared *dispatcher.Metrics) (*Metrics, error) {
	m := &Metrics{shared: shared}
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_requests_total",
		Help: "Requests the gateway answered, by model and outcome: ok, client_error (a 4xx), rejected (429, 503: overload or no workers), error (a 5xx or an in-stream error), cancelled (the client left).",
	}, []string{"model", "outcome"})
	m.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_ttft_seconds", Help: "Time from a request's arrival to its first byte of answer to the client.",
		Buckets: dispatcher.TTFTBuckets,
	}, []string{"model"})
	m.itl = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_itl_seconds", Help: "Time between two streamed chunks written to a client.",
		Buckets: dispatcher.ITLBuckets,
	}, []string{"model"})
	m.e2e = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_e2e_seconds", Help: "Time from a request's arrival to the end of its answer, for answers delivered whole.",
		Buckets: dispatcher.LongBuckets,
	}, []string{"model"})
	m.gatewayRequests = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "pdq_gateway_inflight_requests", Help: "Generation requests this process's gateway holds now, from their arrival to their answer's end.",
	})
	m.gatewayBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "pdq_gateway_inflight_bytes", Help: "Bytes this process's gateway holds now against PDQ_MAX_INFLIGHT_BYTES: request bodies, and replies waiting for their clients.",
	})
	if err := dispatcher.Register(reg, m.requests, m.ttft, m.itl, m.e2e, m.gatewayRequests, m.gatewayBytes); err != nil {
		return nil, err
	}
	return m, nil
}

// Shared are the counters the workers keep too; nil from a nil m.
func (m *Metrics) Shared() *dispatcher.Metrics {
	if m == nil {
		return nil
	}
	return m.shared
}

// Request counts a request the gateway answered, and its latencies: ttft
// and e2e are zero when there was no first byte or no whole answer.
func (m *Metrics) Request(model, outcome string, ttft, e2e time.Duration) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(model, outcome).Inc()
	if ttft > 0 {
		m.ttft.WithLabelValues(model).Observe(ttft.Seconds())
	}
	if e2e > 0 {
		m.e2e.WithLabelValues(model).Observe(e2e.Seconds())
	}
}

// ITL is the observer of the gaps between two chunks written to a client
// of model, to look up once per request rather than once per token; nil
// counts nothing.
func (m *Metrics) ITL(model string) prometheus.Observer {
	if m == nil {
		return nil
	}
	return m.itl.WithLabelValues(model)
}

// GatewayRequest counts a generation request the gateway holds, until the
// function it returns is called, once, at the request's end.
func (m *Metrics) GatewayRequest() (done func()) {
	if m == nil {
		return func() {}
	}
	m.gatewayRequests.Inc()
	return m.gatewayRequests.Dec
}

// GatewayBytes adds n (negative: gives back) to the bytes the gateway
// holds against its byte budget.
func (m *Metrics) GatewayBytes(n int64) {
	if m != nil {
		m.gatewayBytes.Add(float64(n))
	}
}
