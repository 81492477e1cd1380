package stage

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
)

// Metrics are the stage loops' series: their jobs, queues, retries and
// handoffs (a worker's engines and breakers are package workers'). One set serves every loop of a process; a nil *Metrics counts
// nothing.
type Metrics struct {
	// shared are the counters the gateway keeps too.
	shared            *dispatcher.Metrics
	kvReleased        *prometheus.CounterVec
	handoffsWithoutKV *prometheus.CounterVec
	migrations        *prometheus.CounterVec
	queueWait         *prometheus.HistogramVec
	engineTime        *prometheus.HistogramVec
	retries           *prometheus.CounterVec
	inflight          *prometheus.GaugeVec
	queueDepth        *prometheus.GaugeVec
	// wastedPrefills are the handoffs sent back to prefill.
	wastedPrefills *prometheus.CounterVec
	// pulled counts jobs by where the worker took them from.
	pulled *prometheus.CounterVec
	// leasesLapsed counts deliveries whose worker lost touch with NATS
	// for the ack wait (see lease).
	leasesLapsed *prometheus.CounterVec
}

// NewMetrics registers the workers' series with reg; shared are the
// counters the gateway keeps too.
func NewMetrics(reg prometheus.Registerer, shared *dispatcher.Metrics) (*Metrics, error) {
	m := &Metrics{shared: shared,
		kvReleased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_kv_released_total",
			Help: "Handoffs whose prefill KV blocks a decode worker released because they will not be decoded.",
		}, []string{"pool"}),
		handoffsWithoutKV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_kv_params_missing_total",
			Help: "Prefill answers (200) whose kv_transfer_params were missing or could not point a decode engine at the blocks; each was retried, never decoded as a recompute.",
		}, []string{"pool"}),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_migrations_total",
			Help: "Decodes that failed after output and continued on another decode engine.",
		}, []string{"pool"}),
	}
	m.queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_queue_wait_seconds", Help: "Time a job waited in its stage's queue before a worker pulled it.",
		Buckets: dispatcher.LongBuckets,
	}, []string{"stage"})
	m.engineTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_engine_seconds", Help: "Time a stage's engine call took, relay included.",
		Buckets: dispatcher.LongBuckets,
	}, []string{"stage"})
	m.retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_retries_total",
		Help: "Jobs run again, by stage and reason: retry (a failure, after back-off), regenerate (sent back to prefill), hand_back (its worker's engine was failing), running_elsewhere (redelivered while a delivery ran), ack_unconfirmed (a batch prompt's ack JetStream did not confirm: it may run again).",
	}, []string{"stage", "reason"})
	m.inflight = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_inflight", Help: "Jobs this process's workers run now, by stage.",
	}, []string{"stage"})
	m.queueDepth = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_queue_depth", Help: "Jobs waiting in a pool's stage queue, not yet delivered (as its workers last saw it).",
	}, []string{"stage", "pool"})
	m.wastedPrefills = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_prefills_wasted_total",
		Help: "Handoffs sent back to prefill (or failed, out of generations), their prefill's work lost, by reason: kv_ttl (the handoff waited past PDQ_KV_TTL), redelivered (a redelivered handoff, whose KV an earlier delivery may have read), decode_failed, shutdown.",
	}, []string{"reason"})
	m.pulled = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_jobs_pulled_total",
		Help: "Jobs workers took, by stage and where from: shared (the pool's queue), preferred (those that preferred the worker's engine, prefix-cache affinity), taken_over (those that preferred another engine, which was full or gone).",
	}, []string{"stage", "from"})
	m.leasesLapsed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_leases_lapsed_total",
		Help: "Jobs whose worker went the ack wait without an answer from NATS while it ran them (cut off: NATS may have given the job to another worker), by how each ended: kept (still this worker's once back, as after a NATS restart), stopped (taken over meanwhile: its engine call stopped once back), cut_off (stopped while still cut off, past the ack wait and the stall time-out), finished (its engine call ended first: it may have run twice).",
	}, []string{"stage", "outcome"})
	if err := dispatcher.Register(reg, m.kvReleased, m.handoffsWithoutKV, m.migrations, m.queueWait, m.engineTime,
		m.retries, m.inflight, m.queueDepth, m.wastedPrefills, m.pulled, m.leasesLapsed); err != nil {
		return nil, err
	}
	// Zeros from the start, so that a dashboard sees the series before the
	// first failure.
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		m.inflight.WithLabelValues(string(stage))
		for _, from := range []string{pulledShared, pulledPreferred, pulledTakenOver} {
			m.pulled.WithLabelValues(string(stage), from)
		}
		for _, outcome := range []string{lapseKept, lapseStopped, lapseCutOff, lapseFinished} {
			m.leasesLapsed.WithLabelValues(string(stage), outcome)
		}
		for _, reason := range []string{"retry", "regenerate", "hand_back", "running_elsewhere", "ack_unconfirmed"} {
			m.retries.WithLabelValues(string(stage), reason)
		}
	}
	for _, reason := range verdict.WasteReasons() {
		m.wastedPrefills.WithLabelValues(string(reason))
	}
	return m, nil
}

// Shared are the counters the gateway keeps too; nil from a nil m.
func (m *Metrics) Shared() *dispatcher.Metrics {
	if m == nil {
		return nil
	}
	return m.shared
}

// pool shows the series of a pool's stage from the start.
func (m *Metrics) pool(stage dispatcher.Stage, pool string) {
	if m == nil {
		return
	}
	m.queueDepth.WithLabelValues(string(stage), pool)
	if stage == dispatcher.StagePrefill {
		m.handoffsWithoutKV.WithLabelValues(pool)
		m.shared.FallbackSeries(pool, "prefill")
		return
	}
	m.kvReleased.WithLabelValues(pool)
	m.migrations.WithLabelValues(pool)
}

// released counts a handoff whose KV a decode worker released.
func (m *Metrics) released(pool string) {
	if m != nil {
		m.kvReleased.WithLabelValues(pool).Inc()
	}
}

// JobStarted counts a job a worker started, after waiting in its queue
// for wait.
func (m *Metrics) JobStarted(stage dispatcher.Stage, wait time.Duration) {
	if m == nil {
		return
	}
	m.inflight.WithLabelValues(string(stage)).Inc()
	if wait > 0 {
		m.queueWait.WithLabelValues(string(stage)).Observe(wait.Seconds())
	}
}

// JobEnded counts a job that ended, its engine call having taken engine.
func (m *Metrics) JobEnded(stage dispatcher.Stage, engine time.Duration) {
	if m == nil {
		return
	}
	m.inflight.WithLabelValues(string(stage)).Dec()
	if engine > 0 {
		m.engineTime.WithLabelValues(string(stage)).Observe(engine.Seconds())
	}
}

// wasted counts a handoff sent back to prefill, its KV unread.
func (m *Metrics) wasted(reason verdict.Waste) {
	if m != nil {
		m.wastedPrefills.WithLabelValues(string(reason)).Inc()
	}
}

// retry counts a job run again, for reason.
func (m *Metrics) retry(stage dispatcher.Stage, reason string) {
	if m != nil {
		m.retries.WithLabelValues(string(stage), reason).Inc()
	}
}

// lapsed counts a lapsed lease by how it ended.
func (m *Metrics) lapsed(stage dispatcher.Stage, outcome string) {
	if m != nil {
		m.leasesLapsed.WithLabelValues(string(stage), outcome).Inc()
	}
}

// Where a job was pulled from, for pdq_jobs_pulled_total.
const (
	pulledShared    = "shared"
	pulledPreferred = "preferred"
	pulledTakenOver = "taken_over"
)

// pulledFrom counts a job pulled from a source.
func (m *Metrics) pulledFrom(stage dispatcher.Stage, from string) {
	if m != nil {
		m.pulled.WithLabelValues(string(stage), from).Inc()
	}
}

// depth records a pool's queue depth.
func (m *Metrics) depth(stage dispatcher.Stage, pool string, n uint64) {
	if m != nil {
		m.queueDepth.WithLabelValues(string(stage), pool).Set(float64(n))
	}
}

// HandoffWithoutKV counts a prefill answer without usable
// kv_transfer_params.
func (m *Metrics) HandoffWithoutKV(pool string) {
	if m != nil {
		m.handoffsWithoutKV.WithLabelValues(pool).Inc()
	}
}

// Migrated counts a decode continued on another engine.
func (m *Metrics) Migrated(pool string) {
	if m != nil {
		m.migrations.WithLabelValues(pool).Inc()
	}
}
