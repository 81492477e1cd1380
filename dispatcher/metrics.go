package dispatcher

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// The metrics. Each component's series are next to it: the gateway's in
// package gateway, the workers' in package stage. Here are the ones both
// sides count (a dead letter is stored by a worker or by the gateway; a
// prompt goes decode-only at either), the store's health, and the bucket
// bounds all latency histograms use. Every process registers every set,
// so that each exports the same series whatever it runs.

// Metrics are the counters both sides of the contract keep. A nil
// *Metrics counts nothing.
type Metrics struct {
	deadLetters        *prometheus.CounterVec
	deadLettersRefused *prometheus.CounterVec
	decodeOnly         *prometheus.CounterVec
	fallbacks          *prometheus.CounterVec
	// storeWritable is whether each of pdq's file streams stores writes.
	storeWritable *prometheus.GaugeVec
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
	// TTFTBuckets: a first token from 25 ms (a short prompt on an idle
	// engine) to 60 s (a long prompt behind a queue); SLOs are written at
	// 100 ms to 2.5 s.
	TTFTBuckets = []float64{0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	// ITLBuckets: a token after the first, from 5 ms to 5 s; SLOs are
	// written at 25 to 100 ms (40 to 10 tokens a second).
	ITLBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}
	// LongBuckets: a whole answer, a queue wait or an engine call, from
	// 10 ms to 10 minutes (PDQ_REQUEST_TIMEOUT's default).
	LongBuckets = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
)

// NewMetrics registers the shared counters with reg, and the Go runtime's
// and the process's own series.
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
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_prefill_fallbacks_total",
			Help: "Long prompts sent decode-only because their pool had no healthy prefill worker (PDQ_PREFILL_FALLBACK=decode), by where: gateway or prefill worker.",
		}, []string{"pool", "where"}),
		decodeOnly: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdq_decode_only_total",
			Help: "Requests sent decode-only (the decode engine prefills them), by reason: short_prompt, no_healthy_prefill (the fallback), prefill_refused (the prefill engine answered 4xx), or priority (it outranked the prefills let in, every prefill engine taken).",
		}, []string{"reason"}),
		storeWritable: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pdq_store_writable", Help: "1 while a stream of pdq's stores writes, 0 while the server answers about it but not its writes (its disk may be full), as the gateway's store doctor last probed it.",
		}, []string{"stream"}),
	}
	// The Go runtime's and the process's own series (go_*, process_*), as
	// every Go service exports them: memory, GC, CPU seconds, open files.
	// make bench reads go_memstats_alloc_bytes_total for the bytes a
	// request allocates.
	if err := Register(reg, m.deadLetters, m.deadLettersRefused, m.fallbacks, m.decodeOnly, m.storeWritable,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, err
	}
	// Zeros from the start, so that a dashboard sees the series before the
	// first failure.
	for _, stage := range []Stage{StagePrefill, StageDecode} {
		m.deadLetters.WithLabelValues(string(stage))
		m.deadLettersRefused.WithLabelValues(string(stage))
	}
	for _, reason := range []string{"short_prompt", "no_healthy_prefill", "prefill_refused", "priority"} {
		m.decodeOnly.WithLabelValues(reason)
	}
	return m, nil
}

// Register registers cs with reg.
func Register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("register metrics: %w", err)
		}
	}
	return nil
}

// deadLetter counts a request kept for replay.
func (m *Metrics) deadLetter(stage Stage) {
	if m != nil {
		m.deadLetters.WithLabelValues(string(stage)).Inc()
	}
}

// deadLetterRefused counts a failure a full dead-letter stream refused.
func (m *Metrics) deadLetterRefused(stage Stage) {
	if m != nil {
		m.deadLettersRefused.WithLabelValues(string(stage)).Inc()
	}
}

// DecodeOnly counts a request sent decode-only.
func (m *Metrics) DecodeOnly(reason string) {
	if m != nil {
		m.decodeOnly.WithLabelValues(reason).Inc()
	}
}

// Fallback counts a long prompt sent decode-only for want of a healthy
// prefill worker; where is "gateway" or "prefill".
func (m *Metrics) Fallback(pool, where string) {
	if m != nil {
		m.fallbacks.WithLabelValues(pool, where).Inc()
	}
}

// FallbackSeries shows a pool's fallback series from the start.
func (m *Metrics) FallbackSeries(pool, where string) {
	if m != nil {
		m.fallbacks.WithLabelValues(pool, where)
	}
}

// StoreWritable records whether a stream stores its writes.
func (m *Metrics) StoreWritable(stream string, stores bool) {
	if m != nil {
		v := 0.0
		if stores {
			v = 1
		}
		m.storeWritable.WithLabelValues(stream).Set(v)
	}
}
