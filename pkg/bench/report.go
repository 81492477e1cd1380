package bench

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/pdq-dev/pdq/pkg/bench/pyfmt"
)

// Report is what the result block is printed from: the metrics and the
// settings that decide which lines it has.
type Report struct {
	Metrics Metrics
	// Duration is the run's wall time in seconds.
	Duration float64
	// MaxConcurrency is --max-concurrency, 0 if not set.
	MaxConcurrency int
	// RequestRate is --request-rate (+Inf for all at once).
	RequestRate float64
	// Goodput is whether --goodput was given.
	Goodput bool
	// PercentileMetrics are the metrics of --percentile-metrics.
	PercentileMetrics []string
	// QueueTimes and E2ELInclQueue are the extra metrics vLLM keeps with
	// --max-concurrency (the second only with a finite rate), in seconds;
	// nil when not kept.
	QueueTimes, E2ELInclQueue []float64
	// Percentiles are --metric-percentiles, for the extra metrics.
	Percentiles []float64
}

// metricSection is one section of the block: the metric's key in
// --percentile-metrics and the result file, its name in the lines, and
// the section's title.
type metricSection struct{ key, name, header string }

var sections = []metricSection{
	{"ttft", "TTFT", "Time to First Token"},
	{"tpot", "TPOT", "Time per Output Token (excl. 1st token)"},
	{"itl", "ITL", "Inter-token Latency"},
	{"e2el", "E2EL", "End-to-end Latency"},
	{"client_queue_time", "Client Queue Time", "Client-side Queueing"},
	{"e2el_including_client_queue", "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"},
}

// percentileMetricNames are the names --percentile-metrics takes.
var percentileMetricNames = func() []string {
	var n []string
	for _, s := range sections {
		n = append(n, s.key)
	}
	return n
}()

// center is Python's "{s:{c}^{n}}": s centred in n characters of c, the
// odd one on the right.
func center(s string, c byte, n int) string {
	pad := n - utf8.RuneCountInString(s)
	if pad <= 0 {
		return s
	}
	left := pad / 2
	return strings.Repeat(string(c), left) + s + strings.Repeat(string(c), pad-left)
}

// intLine is "{:<40} {:<10}".format(label, v).
func intLine(label string, v int) string {
	return fmt.Sprintf("%-40s %-10d", label, v)
}

// floatLine is "{:<40} {:<10.2f}".format(label, v).
func floatLine(label string, v float64) string {
	return fmt.Sprintf("%-40s %-10s", label, pyFixed2(v))
}

// pyFixed2 is Python's "{:.2f}": Go's %.2f but for "inf", "-inf", "nan".
func pyFixed2(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return pyfmt.Repr(v)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

// percentileWord is vLLM's p_word: "99" for 99.0, "99.9" for 99.9.
func percentileWord(p float64) string {
	if p == math.Trunc(p) && math.Abs(p) < 1e15 {
		return strconv.FormatInt(int64(p), 10)
	}
	return pyfmt.Repr(p)
}

// stats returns the statistics of section key, and whether the block has
// that section.
func (r *Report) stats(key string) (Stat, bool) {
	if !slices.Contains(r.PercentileMetrics, key) {
		return Stat{}, false
	}
	switch key {
	case "ttft":
		return r.Metrics.TTFT, true
	case "tpot":
		return r.Metrics.TPOT, true
	case "itl":
		return r.Metrics.ITL, true
	case "e2el":
		return r.Metrics.E2EL, true
	case "client_queue_time":
		if r.QueueTimes != nil {
			return stat(r.QueueTimes, r.Percentiles), true
		}
	case "e2el_including_client_queue":
		if r.E2ELInclQueue != nil {
			return stat(r.E2ELInclQueue, r.Percentiles), true
		}
	}
	return Stat{}, false
}

// WriteBlock prints vLLM's "Serving Benchmark Result" block, line for line
// as serve.py's benchmark() prints it for a generation backend with a
// tokenizer.
func (r *Report) WriteBlock(w io.Writer) error {
	m := r.Metrics
	lines := []string{
		center(" Serving Benchmark Result ", '=', 50),
		intLine("Successful requests:", m.Completed),
		intLine("Failed requests:", m.Failed),
	}
	if r.MaxConcurrency > 0 {
		lines = append(lines, intLine("Maximum request concurrency:", r.MaxConcurrency))
	}
	if !math.IsInf(r.RequestRate, 1) {
		lines = append(lines, floatLine("Request rate configured (RPS):", r.RequestRate))
	}
	lines = append(lines,
		floatLine("Benchmark duration (s):", r.Duration),
		intLine("Total input tokens:", m.TotalInput),
		intLine("Total generated tokens:", m.TotalOutput),
		floatLine("Request throughput (req/s):", m.RequestThroughput),
	)
	if r.Goodput {
		lines = append(lines, floatLine("Request goodput (req/s):", m.RequestGoodput))
	}
	lines = append(lines,
		floatLine("Output token throughput (tok/s):", m.OutputThroughput),
		floatLine("Peak output token throughput (tok/s):", m.MaxOutputTokensPerS),
		floatLine("Peak concurrent requests:", float64(m.MaxConcurrentRequests)),
		floatLine("Total token throughput (tok/s):", m.TotalTokenThroughput),
	)
	for _, s := range sections {
		st, ok := r.stats(s.key)
		if !ok {
			continue
		}
		lines = append(lines,
			center(s.header, '-', 50),
			floatLine("Mean "+s.name+" (ms):", st.Mean),
			floatLine("Median "+s.name+" (ms):", st.Median),
		)
		for _, p := range st.Percentiles {
			lines = append(lines, floatLine("P"+percentileWord(p[0])+" "+s.name+" (ms):", p[1]))
		}
	}
	lines = append(lines, strings.Repeat("=", 50))
	_, err := io.WriteString(w, strings.Join(lines, "\n")+"\n")
	return err
}

// addStats adds the printed metrics' statistics to the result, as vLLM's
// process_one_metric does: mean_X_ms, median_X_ms, std_X_ms, pN_X_ms.
func (r *Report) addStats(res *pyfmt.Object) {
	for _, s := range sections {
		st, ok := r.stats(s.key)
		if !ok {
			continue
		}
		res.Set("mean_"+s.key+"_ms", st.Mean)
		res.Set("median_"+s.key+"_ms", st.Median)
		res.Set("std_"+s.key+"_ms", st.Std)
		for _, p := range st.Percentiles {
			res.Set("p"+percentileWord(p[0])+"_"+s.key+"_ms", p[1])
		}
	}
}
