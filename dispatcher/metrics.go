package dispatcher

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics are the stage loops' counters. One set serves every loop of a
// process; a nil *Metrics counts nothing.
type Metrics struct {
	DeadLetters        *prometheus.CounterVec
	DeadLettersRefused *prometheus.CounterVec
	kvReleased         *prometheus.CounterVec
	handoffsWithoutKV  *prometheus.CounterVec
	breakerOpens       *prometheus.CounterVec
	fallbacks          *prometheus.CounterVec
	migrations         *prometheus.CounterVec

	// The gateway's, per request.
	requests   *prometheus.CounterVec
	ttft       *prometheus.HistogramVec
	itl        *prometheus.HistogramVec
	e2e        *prometheus.HistogramVec
	decodeOnly *prometheus.CounterVec
	// The workers', per job.
	queueWait  *prometheus.HistogramVec
	engineTime *prometheus.HistogramVec
	retries    *prometheus.CounterVec
	inflight   *prometheus.GaugeVec
	queueDepth *prometheus.GaugeVec
	engineUp   *prometheus.GaugeVec
	// breakerState is each engine's breaker, one series per state.
	breakerState *prometheus.GaugeVec
	// engineSlots is each engine's slots now, wastedPrefills the handoffs
	// sent back to prefill.
	engineSlots    *prometheus.GaugeVec
	WastedPrefills *prometheus.CounterVec
	// storeWritableVec is whether each of pdq's file streams stores writes.
	storeWritableVec *prometheus.GaugeVec
	// The gateway's load: generation requests it holds and the bytes its
	// byte budget counts (PDQ_MAX_INFLIGHT_BYTES).
	gatewayRequests prometheus.Gauge
	gatewayBytes    prometheus.Gauge
}

// Bucket bounds are round numbers that an operator can write an SLO
// against: the share of requests under a bound is exact at a bucket's
// bound (rate of its le bucket over the count) and only interpolated
// between bounds, so each bound is one an SLO would name. They step 1,
// 2.5, 5 per decade (past 10 s: 30 s, then whole minutes), which bounds
// histogram_quantile's error by a bucket's width and keeps the buckets
// few: every bound is a series per label value. Most are also vLLM's own bounds
// (vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds), so
// that pdq's latency and its engines' can be compared at the same le.
var (
	// ttftBuckets: a first token from 25 ms (a short prompt on an idle
	// engine) to 60 s (a long prompt behind a queue); SLOs are written at
	// 100 ms to 2.5 s.
	ttftBuckets = []float64{0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	// itlBuckets: a token after the first, from 5 ms to 5 s; SLOs are
	// written at 25 to 100 ms (40 to 10 tokens a second).
	itlBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}
	// longBuckets: a whole answer, a queue wait or an engine call, from
	// 10 ms to 10 minutes (PDQ_REQUEST_TIMEOUT's default).
	longBuckets = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
)

// NewMetrics registers the counters with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		DeadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_dead_letters_total",
			Help: "Failed requests kept in PDQ_DLQ for replay, by the stage they failed in.",
		}, []string{"stage"}),
		DeadLettersRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_dead_letters_refused_total",
			Help: "Failed requests a full PDQ_DLQ refused to keep (it drops no older entry to make room).",
		}, []string{"stage"}),
		kvReleased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_kv_released_total",
			Help: "Handoffs whose prefill KV blocks a decode worker released because they will not be decoded.",
		}, []string{"pool"}),
		handoffsWithoutKV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_kv_params_missing_total",
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
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_requests_total",
		Help: "Requests the gateway answered, by model and outcome: ok, client_error (a 4xx), rejected (429, 503: overload or no workers), error (a 5xx or an in-stream error), cancelled (the client left).",
	}, []string{"model", "outcome"})
	m.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_ttft_seconds", Help: "Time from a request's arrival to its first byte of answer to the client.",
		Buckets: ttftBuckets,
	}, []string{"model"})
	m.itl = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_itl_seconds", Help: "Time between two streamed chunks written to a client.",
		Buckets: itlBuckets,
	}, []string{"model"})
	m.e2e = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_e2e_seconds", Help: "Time from a request's arrival to the end of its answer, for answers delivered whole.",
		Buckets: longBuckets,
	}, []string{"model"})
	m.decodeOnly = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_decode_only_total",
		Help: "Requests sent decode-only (the decode engine prefills them), by reason: short_prompt, no_healthy_prefill (the fallback), or prefill_refused (the prefill engine answered 4xx).",
	}, []string{"reason"})
	m.queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_queue_wait_seconds", Help: "Time a job waited in its stage's queue before a worker pulled it.",
		Buckets: longBuckets,
	}, []string{"stage"})
	m.engineTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "pdq_engine_seconds", Help: "Time a stage's engine call took, relay included.",
		Buckets: longBuckets,
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
	m.engineUp = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_engine_up", Help: "1 while a worker's engine takes jobs (its breaker closed), 0 while it does not (its breaker open, or half-open: one trial job at most); pdq_engine_breaker_state says which.",
	}, []string{"stage", "engine"})
	m.breakerState = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_engine_breaker_state", Help: "A worker's circuit breaker on its engine: 1 for its state (closed, half-open, open), 0 for the others.",
	}, []string{"stage", "engine", "state"})
	m.gatewayRequests = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "pdq_gateway_inflight_requests", Help: "Generation requests this process's gateway holds now, from their arrival to their answer's end.",
	})
	m.gatewayBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "pdq_gateway_inflight_bytes", Help: "Bytes this process's gateway holds now against PDQ_MAX_INFLIGHT_BYTES: request bodies, and replies waiting for their clients.",
	})
	m.engineSlots = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_engine_slots", Help: "Jobs a worker gives its engine at once now: PDQ_ENGINE_SLOTS at most, fewer while the engine queues what it is given.",
	}, []string{"stage", "engine"})
	m.storeWritableVec = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_store_writable", Help: "1 while a stream of pdq's stores writes, 0 while the server answers about it but not its writes (its disk may be full), as the gateway's store doctor last probed it.",
	}, []string{"stream"})
	m.WastedPrefills = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdq_prefills_wasted_total",
		Help: "Handoffs sent back to prefill (or failed, out of generations), their prefill's work lost, by reason: kv_ttl (the handoff waited past PDQ_KV_TTL), redelivered (a redelivered handoff, whose KV an earlier delivery may have read), decode_failed, shutdown.",
	}, []string{"reason"})
	// The Go runtime's and the process's own series (go_*, process_*), as
	// every Go service exports them: memory, GC, CPU seconds, open files.
	// make bench reads go_memstats_alloc_bytes_total for the bytes a
	// request allocates.
	for _, c := range append(m.collectors(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})) {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	// Zeros from the start, so that a dashboard sees the series before the
	// first failure.
	for _, stage := range []Stage{StagePrefill, StageDecode} {
		m.DeadLetters.WithLabelValues(string(stage))
		m.DeadLettersRefused.WithLabelValues(string(stage))
		m.breakerOpens.WithLabelValues(string(stage))
		m.inflight.WithLabelValues(string(stage))
		for _, reason := range []string{"retry", "regenerate", "hand_back", "running_elsewhere", "ack_unconfirmed"} {
			m.retries.WithLabelValues(string(stage), reason)
		}
	}
	for _, reason := range []string{"short_prompt", "no_healthy_prefill", "prefill_refused"} {
		m.decodeOnly.WithLabelValues(reason)
	}
	for _, reason := range WasteReasons {
		m.WastedPrefills.WithLabelValues(string(reason))
	}
	return m, nil
}

// collectors are every metric of the set.
func (m *Metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.DeadLetters, m.DeadLettersRefused, m.kvReleased,
		m.handoffsWithoutKV, m.breakerOpens, m.fallbacks, m.migrations,
		m.requests, m.ttft, m.itl, m.e2e, m.decodeOnly, m.queueWait, m.engineTime, m.retries,
		m.inflight, m.queueDepth, m.engineUp, m.breakerState, m.engineSlots, m.WastedPrefills, m.storeWritableVec,
		m.gatewayRequests, m.gatewayBytes}
}

// Pool shows the series of a pool's stage from the start.
func (m *Metrics) Pool(stage Stage, pool string) {
	if m == nil {
		return
	}
	m.queueDepth.WithLabelValues(string(stage), pool)
	if stage == StagePrefill {
		m.handoffsWithoutKV.WithLabelValues(pool)
		m.fallbacks.WithLabelValues(pool, "prefill")
		return
	}
	m.kvReleased.WithLabelValues(pool)
	m.migrations.WithLabelValues(pool)
}

func (m *Metrics) DeadLetter(stage Stage) {
	if m != nil {
		m.DeadLetters.WithLabelValues(string(stage)).Inc()
	}
}

func (m *Metrics) DeadLetterRefused(stage Stage) {
	if m != nil {
		m.DeadLettersRefused.WithLabelValues(string(stage)).Inc()
	}
}

func (m *Metrics) Released(pool string) {
	if m != nil {
		m.kvReleased.WithLabelValues(pool).Inc()
	}
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

// DecodeOnly counts a request sent decode-only.
func (m *Metrics) DecodeOnly(reason string) {
	if m != nil {
		m.decodeOnly.WithLabelValues(reason).Inc()
	}
}

// EngineUp records a worker's engine health: its breaker state. The
// engine is up only while its breaker is closed: a half-open breaker lets
// one trial job through, not the pool's share of the work, so it counts as
// down, and pdq_engine_breaker_state tells half-open from open.
func (m *Metrics) EngineUp(stage Stage, engine string, state BreakerState) {
	if m == nil {
		return
	}
	up := 0.0
	if state == BreakerClosed {
		up = 1
	}
	m.engineUp.WithLabelValues(string(stage), engine).Set(up)
	// One series for each value of the state label.
	for _, s := range [...]BreakerState{BreakerClosed, BreakerHalfOpen, BreakerOpen} {
		v := 0.0
		if s == state {
			v = 1
		}
		m.breakerState.WithLabelValues(string(stage), engine, string(s)).Set(v)
	}
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

func (m *Metrics) JobStarted(stage Stage, wait time.Duration) {
	if m == nil {
		return
	}
	m.inflight.WithLabelValues(string(stage)).Inc()
	if wait > 0 {
		m.queueWait.WithLabelValues(string(stage)).Observe(wait.Seconds())
	}
}

func (m *Metrics) JobEnded(stage Stage, engine time.Duration) {
	if m == nil {
		return
	}
	m.inflight.WithLabelValues(string(stage)).Dec()
	if engine > 0 {
		m.engineTime.WithLabelValues(string(stage)).Observe(engine.Seconds())
	}
}

// EngineSlots reports the slots a worker gives its engine now.
func (m *Metrics) EngineSlots(stage Stage, engine string, n int) {
	if m != nil {
		m.engineSlots.WithLabelValues(string(stage), engine).Set(float64(n))
	}
}

func (m *Metrics) StoreWritable(stream string, stores bool) {
	if m != nil {
		v := 0.0
		if stores {
			v = 1
		}
		m.storeWritableVec.WithLabelValues(stream).Set(v)
	}
}

func (m *Metrics) Wasted(reason Waste) {
	if m != nil {
		m.WastedPrefills.WithLabelValues(string(reason)).Inc()
	}
}

func (m *Metrics) Retry(stage Stage, reason string) {
	if m != nil {
		m.retries.WithLabelValues(string(stage), reason).Inc()
	}
}

func (m *Metrics) Depth(stage Stage, pool string, n uint64) {
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

// Waste is why a prefill's KV went unread: pdq_prefills_wasted_total's
// reason.
type Waste string

const (
	WasteKVTTL        Waste = "kv_ttl"
	WasteRedelivered  Waste = "redelivered"
	WasteDecodeFailed Waste = "decode_failed"
	WasteShutdown     Waste = "shutdown"
)

var WasteReasons = []Waste{WasteKVTTL, WasteRedelivered, WasteDecodeFailed, WasteShutdown}
