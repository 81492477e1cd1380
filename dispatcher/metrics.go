package dispatcher

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the stage loops' counters. One set serves every loop of a
// process; a nil *Metrics counts nothing.
type Metrics struct {
	deadLetters        *prometheus.CounterVec
	deadLettersRefused *prometheus.CounterVec
	kvReleased         *prometheus.CounterVec
}

// NewMetrics registers the counters with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_dead_letters_total",
			Help: "Failed requests kept in PDQ_DLQ for replay, by the stage they failed in.",
		}, []string{"stage"}),
		deadLettersRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_dead_letters_refused_total",
			Help: "Failed requests a full PDQ_DLQ refused to keep (it drops no older entry to make room).",
		}, []string{"stage"}),
		kvReleased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_kv_released_total",
			Help: "Handoffs whose prefill KV blocks a decode worker released because they will not be decoded.",
		}, []string{"pool"}),
	}
	for _, c := range []prometheus.Collector{m.deadLetters, m.deadLettersRefused, m.kvReleased} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	// Zeros from the start, so that a dashboard sees the series before the
	// first failure.
	for _, stage := range []Stage{StagePrefill, StageDecode} {
		m.deadLetters.WithLabelValues(string(stage))
		m.deadLettersRefused.WithLabelValues(string(stage))
	}
	return m, nil
}

// pool shows pool's series from the start.
func (m *Metrics) pool(pool string) {
	if m != nil {
		m.kvReleased.WithLabelValues(pool)
	}
}

func (m *Metrics) deadLetter(stage Stage) {
	if m != nil {
		m.deadLetters.WithLabelValues(string(stage)).Inc()
	}
}

func (m *Metrics) deadLetterRefused(stage Stage) {
	if m != nil {
		m.deadLettersRefused.WithLabelValues(string(stage)).Inc()
	}
}

func (m *Metrics) released(pool string) {
	if m != nil {
		m.kvReleased.WithLabelValues(pool).Inc()
	}
}
