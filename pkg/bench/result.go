package bench

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/pkg/bench/pyfmt"
)

// Result is what a run gave.
type Result struct {
	Report Report
	// JSON is the result as vLLM's --save-result writes it (before the
	// per-request lists are dropped without --save-detailed).
	JSON pyfmt.Object
	// File is where the result was saved, "" if it was not.
	File string
	// Outputs are the requests' outputs, in the dataset's order.
	Outputs []Output
	// Groups are the figures of each tenant and each priority.
	Groups []Group
}

// MarshalJSON writes the result file's JSON: Python's json.dump of vLLM's
// result dict.
func (r *Result) MarshalJSON() ([]byte, error) {
	s, err := pyfmt.Dumps(r.JSON)
	return []byte(s), err
}

// resultJSON is vLLM's result_json: the run's settings, then benchmark()'s
// result dict, then the printed metrics' statistics.
func resultJSON(cfg Config, modelID string, now time.Time, rep *Report, outputs []Output) pyfmt.Object {
	var r pyfmt.Object
	r.Set("date", now.Format("20060102-150405"))
	r.Set("endpoint_type", cfg.Backend)
	r.Set("backend", cfg.Backend)
	r.Set("label", nilIfEmpty(cfg.Label))
	r.Set("model_id", modelID)
	r.Set("tokenizer_id", nil) // pdq bench has no tokenizer
	r.Set("num_prompts", cfg.NumPrompts)
	if math.IsInf(cfg.RequestRate, 1) {
		r.Set("request_rate", "inf")
	} else {
		r.Set("request_rate", cfg.RequestRate)
	}
	r.Set("burstiness", cfg.Burstiness)
	if cfg.MaxConcurrency > 0 {
		r.Set("max_concurrency", cfg.MaxConcurrency)
	} else {
		r.Set("max_concurrency", nil)
	}

	m := &rep.Metrics
	r.Set("duration", rep.Duration)
	r.Set("completed", m.Completed)
	r.Set("failed", m.Failed)
	r.Set("total_input_tokens", m.TotalInput)
	r.Set("total_output_tokens", m.TotalOutput)
	r.Set("request_throughput", m.RequestThroughput)
	if rep.Goodput {
		r.Set("request_goodput", m.RequestGoodput)
	} else {
		r.Set("request_goodput", nil)
	}
	r.Set("output_throughput", m.OutputThroughput)
	r.Set("total_token_throughput", m.TotalTokenThroughput)
	n := len(outputs)
	inputLens, ttfts, latencies := make([]int, n), make([]float64, n), make([]float64, n)
	starts, queues := make([]float64, n), make([]float64, n)
	itls, texts, errs := make([][]float64, n), make([]string, n), make([]string, n)
	for i, o := range outputs {
		inputLens[i], ttfts[i], latencies[i] = o.PromptLen, o.TTFT, o.Latency
		starts[i], queues[i] = o.StartTime, o.ClientQueueTime
		itls[i], texts[i], errs[i] = o.ITL, o.GeneratedText, o.Error
		if itls[i] == nil {
			itls[i] = []float64{}
		}
	}
	r.Set("input_lens", inputLens)
	r.Set("output_lens", m.OutputLens)
	r.Set("ttfts", ttfts)
	r.Set("itls", itls)
	r.Set("latencies", latencies)
	r.Set("start_times", starts)
	r.Set("queue_times", queues)
	r.Set("generated_texts", texts)
	r.Set("errors", errs)
	r.Set("max_output_tokens_per_s", m.MaxOutputTokensPerS)
	r.Set("max_concurrent_requests", m.MaxConcurrentRequests)
	r.Set("rtfx", 0.0)
	rep.addStats(&r)
	return r
}

// resultFilename is vLLM's compute_result_filename without a ramp-up:
// {label}-{request_rate}qps[-concurrency{n}]-{model}-{date}.json, or
// --result-filename.
func resultFilename(cfg Config, modelID string, res pyfmt.Object) string {
	if cfg.ResultFilename != "" {
		return cfg.ResultFilename
	}
	label := cfg.Label
	if label == "" {
		label = cfg.Backend
	}
	conc := ""
	if cfg.MaxConcurrency > 0 {
		conc = "-concurrency" + strconv.Itoa(cfg.MaxConcurrency)
	}
	date, _ := res.Get("date")
	base := modelID[strings.LastIndex(modelID, "/")+1:]
	return fmt.Sprintf("%s-%sqps%s-%s-%s.json", label, pyfmt.Repr(cfg.RequestRate), conc, base, date)
}

// nilIfEmpty is Python's None for an unset string, as vLLM's result dict
// holds an unset --label.
func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}
