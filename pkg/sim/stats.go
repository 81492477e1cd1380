package sim

import (
	"sync/atomic"

	"github.com/pdq-dev/pdq/pkg/sim/kvstore"
	"github.com/pdq-dev/pdq/pkg/sim/sched"
	"github.com/prometheus/client_golang/prometheus"
)

// Stats are the engine's counters, served at GET /sim/stats for tests to
// assert on. Request counters count requests that finished; a request that
// fails or is aborted is counted where it failed instead. Prefills,
// Decodes and Local count engine requests: a completions request with a
// batch of prompts is one per prompt.
type Stats struct {
	// Requests is every generation or embedding request received, good or
	// bad.
	Requests int64 `json:"requests"`
	// Prefills finished with do_remote_decode and returned kv_transfer_params.
	Prefills int64 `json:"prefills"`
	// Decodes finished with do_remote_prefill (KV loaded or recomputed).
	Decodes int64 `json:"decodes"`
	// Local finished as plain requests (prefill and decode on this engine).
	Local int64 `json:"local"`
	// KVReads are successful reads of a prefill's blocks by this engine.
	KVReads int64 `json:"kv_reads"`
	// KVReadFailures are KV loads that failed (unknown id, expired lease,
	// unreachable or incompatible prefill engine).
	KVReadFailures int64 `json:"kv_read_failures"`
	// KVMismatches are KV loads whose blocks held another prompt: the decode
	// then says what that prompt's answer would be, as vLLM silently would.
	KVMismatches int64 `json:"kv_mismatches"`
	// Recomputes are decode requests that prefilled locally after a failed
	// KV load (--kv-load-failure recompute).
	Recomputes int64 `json:"recomputes"`
	// KVServed are reads of this engine's blocks by decode engines.
	KVServed int64 `json:"kv_served"`
	// BlocksHeld is the number of blocks held for decode engines now.
	BlocksHeld int64 `json:"blocks_held"`
	// BlocksExpired and HoldsExpired count blocks, and prefills, freed
	// because no decode engine read them within the lease.
	BlocksExpired int64 `json:"blocks_expired"`
	HoldsExpired  int64 `json:"holds_expired"`
	// UnknownNotifs are release notifications for ids not held here.
	UnknownNotifs int64 `json:"unknown_notifs"`
	// RequestIDMismatches are reads whose decode leg carried another
	// X-Request-Id than the prefill leg: harmless in v2, fatal in v1.
	RequestIDMismatches int64 `json:"request_id_mismatches"`
	// Aborts are requests whose client went away before the end.
	Aborts int64 `json:"aborts"`
	// Faults are injected faults.
	Faults int64 `json:"faults"`
	// Errors are requests answered with an error: bad input, engine errors.
	Errors int64 `json:"errors"`
	// Running and Waiting are requests in the engine now.
	Running int64 `json:"running"`
	Waiting int64 `json:"waiting"`
	// PromptTokens and GenerationTokens sum the usage of finished requests.
	PromptTokens     int64 `json:"prompt_tokens"`
	GenerationTokens int64 `json:"generation_tokens"`
	// EngineDead is set once the engine has died (v1 request-id mismatch).
	EngineDead bool `json:"engine_dead"`

	// The scheduler's figures, on a batched engine (--profile): KV blocks
	// in use (held prefill blocks too) of all, prompt tokens looked up in
	// the prefix cache and found there, preemptions and engine steps.
	KVBlocksUsed      int   `json:"kv_blocks_used,omitempty"`
	KVBlocks          int   `json:"kv_blocks,omitempty"`
	PrefixQueryTokens int64 `json:"prefix_query_tokens,omitempty"`
	PrefixHitTokens   int64 `json:"prefix_hit_tokens,omitempty"`
	Preemptions       int64 `json:"preemptions,omitempty"`
	Steps             int64 `json:"steps,omitempty"`
	// BusySeconds is the time the engine spent in steps.
	BusySeconds float64 `json:"busy_seconds,omitempty"`
}

type counters struct {
	requests, prefills, decodes, local                atomic.Int64
	kvReads, kvReadFailures, kvMismatches, recomputes atomic.Int64
	kvServed                                          atomic.Int64
	kv                                                kvstore.Counters
	unknownNotifs, requestIDMismatches                atomic.Int64
	aborts, faults, errors, running, waiting          atomic.Int64
	promptTokens, generationTokens                    atomic.Int64
}

func (e *Engine) snapshot() Stats {
	c := &e.stats
	sc := e.schedStats()
	return Stats{
		KVBlocksUsed: sc.UsedBlocks, KVBlocks: sc.NumBlocks, PrefixQueryTokens: sc.PrefixQueries,
		PrefixHitTokens: sc.PrefixHits, Preemptions: sc.Preemptions, Steps: sc.Steps, BusySeconds: sc.Busy.Seconds(),
		Requests: c.requests.Load(), Prefills: c.prefills.Load(), Decodes: c.decodes.Load(), Local: c.local.Load(),
		KVReads: c.kvReads.Load(), KVReadFailures: c.kvReadFailures.Load(), KVMismatches: c.kvMismatches.Load(),
		Recomputes: c.recomputes.Load(), KVServed: c.kvServed.Load(), BlocksHeld: c.kv.BlocksHeld.Load(),
		BlocksExpired: c.kv.BlocksExpired.Load(), HoldsExpired: c.kv.HoldsExpired.Load(),
		UnknownNotifs: c.unknownNotifs.Load(), RequestIDMismatches: c.requestIDMismatches.Load(),
		Aborts: c.aborts.Load(), Faults: c.faults.Load(), Errors: c.errors.Load(),
		Running: c.running.Load(), Waiting: c.waiting.Load(),
		PromptTokens: c.promptTokens.Load(), GenerationTokens: c.generationTokens.Load(),
		EngineDead: e.dead.Load(),
	}
}

// schedStats are the scheduler's figures; zero on an engine of fixed
// latencies.
func (e *Engine) schedStats() sched.Stats {
	if e.batch == nil {
		return sched.Stats{}
	}
	return e.batch.Stats()
}

// newRegistry exposes the counters as Prometheus metrics: vLLM's names for
// what vLLM also reports, pdq_sim_ for the rest. Values are read at scrape
// time, so there is one source of truth.
func (e *Engine) newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	// vLLM labels its metrics with the first served name.
	labels := prometheus.Labels{"model_name": e.names.served[0]}
	gauge := func(name, help string, v *atomic.Int64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return float64(v.Load()) })
	}
	counter := func(name, help string, v *atomic.Int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return float64(v.Load()) })
	}
	c := &e.stats
	reg.MustRegister(
		gauge("vllm:num_requests_running", "Requests running on the engine.", &c.running),
		gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", &c.waiting),
		counter("vllm:prompt_tokens_total", "Prompt tokens of finished requests.", &c.promptTokens),
		counter("vllm:generation_tokens_total", "Generated tokens of finished requests.", &c.generationTokens),
		counter("pdq_sim_requests_total", "Generation requests received.", &c.requests),
		counter("pdq_sim_prefills_total", "Prefills that returned kv_transfer_params.", &c.prefills),
		counter("pdq_sim_decodes_total", "Remote-prefilled requests finished.", &c.decodes),
		counter("pdq_sim_local_total", "Plain requests finished.", &c.local),
		counter("pdq_sim_kv_reads_total", "KV blocks read from prefill engines.", &c.kvReads),
		counter("pdq_sim_kv_read_failures_total", "Failed KV loads.", &c.kvReadFailures),
		counter("pdq_sim_kv_mismatches_total", "KV loads that held another prompt.", &c.kvMismatches),
		counter("pdq_sim_recomputes_total", "Decodes that recomputed the prompt after a failed KV load.", &c.recomputes),
		counter("pdq_sim_kv_served_total", "Reads of this engine's KV blocks.", &c.kvServed),
		gauge("pdq_sim_blocks_held", "KV blocks held for decode engines.", &c.kv.BlocksHeld),
		counter("pdq_sim_blocks_expired_total", "KV blocks freed at lease expiry.", &c.kv.BlocksExpired),
		counter("pdq_sim_request_id_mismatches_total", "KV reads whose legs carried different X-Request-Ids.", &c.requestIDMismatches),
		counter("pdq_sim_aborts_total", "Requests aborted by their client.", &c.aborts),
		counter("pdq_sim_faults_total", "Injected faults.", &c.faults),
		counter("pdq_sim_errors_total", "Requests answered with an error.", &c.errors),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm:kv_cache_usage_perc", Help: "KV-cache usage. 1 means 100 percent usage.", ConstLabels: labels},
			func() float64 { return e.schedStats().KVUsage() }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "vllm:prefix_cache_queries_total", Help: "Prefix cache queries, in terms of number of queried tokens.", ConstLabels: labels},
			func() float64 { return float64(e.schedStats().PrefixQueries) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "vllm:prefix_cache_hits_total", Help: "Prefix cache hits, in terms of number of cached tokens.", ConstLabels: labels},
			func() float64 { return float64(e.schedStats().PrefixHits) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "vllm:num_preemptions_total", Help: "Cumulative number of preemption from the engine.", ConstLabels: labels},
			func() float64 { return float64(e.schedStats().Preemptions) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "pdq_sim_busy_seconds_total", Help: "Time the engine spent in steps (--profile).", ConstLabels: labels},
			func() float64 { return e.schedStats().Busy.Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pdq_sim_engine_dead", Help: "1 once the engine has died.", ConstLabels: labels},
			func() float64 {
				if e.dead.Load() {
					return 1
				}
				return 0
			}),
	)
	return reg
}
