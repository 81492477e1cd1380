package workers

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdq-dev/pdq/dispatcher"
)

// Metrics are a worker's engine series: its breaker's state and openings,
// and the slots it gives the engine. A nil *Metrics counts nothing.
type Metrics struct {
	engineUp *prometheus.GaugeVec
	// breakerState is each engine's breaker, one series per state.
	breakerState *prometheus.GaugeVec
	breakerOpens *prometheus.CounterVec
	// engineSlots is each engine's slots now.
	engineSlots *prometheus.GaugeVec
}

// NewMetrics registers the engine series with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{}
	m.breakerOpens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_breaker_opens_total",
		Help: "Times a worker's circuit breaker opened on its engine: it stopped pulling and probed /health.",
	}, []string{"stage"})
	m.engineUp = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_engine_up", Help: "1 while a worker's engine takes jobs (its breaker closed), 0 while it does not (its breaker open, or half-open: one trial job at most); pdq_engine_breaker_state says which.",
	}, []string{"stage", "engine"})
	m.breakerState = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_engine_breaker_state", Help: "A worker's circuit breaker on its engine: 1 for its state (closed, half-open, open), 0 for the others.",
	}, []string{"stage", "engine", "state"})
	m.engineSlots = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_engine_slots", Help: "Jobs a worker gives its engine at once now: PDQ_ENGINE_SLOTS at most, fewer while the engine queues what it is given.",
	}, []string{"stage", "engine"})
	if err := dispatcher.Register(reg, m.engineUp, m.breakerState, m.breakerOpens, m.engineSlots); err != nil {
		return nil, err
	}
	// Zeros from the start, so that a dashboard sees the series before the
	// first breaker opens.
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		m.breakerOpens.WithLabelValues(string(stage))
	}
	return m, nil
}

// EngineUp records a worker's engine health: its breaker state. The
// engine is up only while its breaker is closed: a half-open breaker lets
// one trial job through, not the pool's share of the work, so it counts as
// down, and pdq_engine_breaker_state tells half-open from open.
func (m *Metrics) EngineUp(stage dispatcher.Stage, engine string, state dispatcher.BreakerState) {
	if m == nil {
		return
	}
	up := 0.0
	if state == dispatcher.BreakerClosed {
		up = 1
	}
	m.engineUp.WithLabelValues(string(stage), engine).Set(up)
	// One series for each value of the state label.
	for _, s := range [...]dispatcher.BreakerState{dispatcher.BreakerClosed, dispatcher.BreakerHalfOpen, dispatcher.BreakerOpen} {
		v := 0.0
		if s == state {
			v = 1
		}
		m.breakerState.WithLabelValues(string(stage), engine, string(s)).Set(v)
	}
}

// EngineSlots reports the slots a worker gives its engine now.
func (m *Metrics) EngineSlots(stage dispatcher.Stage, engine string, n int) {
	if m != nil {
		m.engineSlots.WithLabelValues(string(stage), engine).Set(float64(n))
	}
}

// BreakerOpened counts a circuit breaker that opened.
func (m *Metrics) BreakerOpened(stage dispatcher.Stage) {
	if m != nil {
		m.breakerOpens.WithLabelValues(string(stage)).Inc()
	}
}
