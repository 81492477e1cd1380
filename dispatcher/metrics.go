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
	handoffsWithoutKV  *prometheus.CounterVec
	breakerOpens       *prometheus.CounterVec
	fallbacks          *prometheus.CounterVec
	migrations         *prometheus.CounterVec
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
		handoffsWithoutKV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_handoffs_without_kv_total",
			Help: "Prefill answers (200) whose kv_transfer_params were missing or could not point a decode engine at the blocks; each was retried, never decoded as a recompute.",
		}, []string{"pool"}),
		breakerOpens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_breaker_opens_total",
			Help: "Times a worker's circuit breaker opened on its engine: it stopped pulling and probed /health.",
		}, []string{"stage"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_prefill_fallbacks_total",
			Help: "Long prompts sent decode-only because their pool had no healthy prefill worker (PDQ_PREFILL_FALLBACK=decode), by where: gateway or prefill worker.",
		}, []string{"pool", "where"}),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_migrations_total",
			Help: "Decodes that failed after output and continued on another decode engine.",
		}, []string{"pool"}),
	}
	for _, c := range []prometheus.Collector{m.deadLetters, m.deadLettersRefused, m.kvReleased,
		m.handoffsWithoutKV, m.breakerOpens, m.fallbacks, m.migrations} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	// Zeros from the start, so that a dashboard sees the series before the
	// first failure.
	for _, stage := range []Stage{StagePrefill, StageDecode} {
		m.deadLetters.WithLabelValues(string(stage))
		m.deadLettersRefused.WithLabelValues(string(stage))
		m.breakerOpens.WithLabelValues(string(stage))
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

// HandoffWithoutKV counts a prefill answer without usable
// kv_transfer_params.
func (m *Metrics) HandoffWithoutKV(pool string) {
	if m != nil {
		m.handoffsWithoutKV.WithLabelValues(pool).Inc()
	}
}

// BreakerOpened counts a circuit breaker that opened.
func (m *Metrics) BreakerOpened(stage Stage) {
	if m != nil {
		m.breakerOpens.WithLabelValues(string(stage)).Inc()
	}
}

// Fallback counts a long prompt sent decode-only for want of a healthy
// prefill worker; where is "gateway" or "prefill".
func (m *Metrics) Fallback(pool, where string) {
	if m != nil {
		m.fallbacks.WithLabelValues(pool, where).Inc()
	}
}

// Migrated counts a decode continued on another engine.
func (m *Metrics) Migrated(pool string) {
	if m != nil {
		m.migrations.WithLabelValues(pool).Inc()
	}
}
