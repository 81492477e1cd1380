package bench

import (
	"math"
	"slices"

	"github.com/pdq-dev/pdq/pkg/bench/pyfmt"
)

// Goodput holds the service-level objectives of --goodput, in
// milliseconds; a nil field is not checked.
type Goodput struct {
	TTFT, TPOT, E2EL *float64
}

// set reports whether any objective is set.
func (g Goodput) set() bool { return g.TTFT != nil || g.TPOT != nil || g.E2EL != nil }

// Stat is one metric's statistics in milliseconds.
type Stat struct {
	Mean, Median, Std float64
	// Percentiles are (p, value) pairs in the order of --metric-percentiles.
	Percentiles [][2]float64
}

// Metrics are a run's results, vLLM's BenchmarkMetrics.
type Metrics struct {
	Completed, Failed                 int
	TotalInput, TotalOutput           int
	RequestThroughput, RequestGoodput float64
	OutputThroughput                  float64
	TotalTokenThroughput              float64
	TTFT, TPOT, ITL, E2EL             Stat
	// MaxOutputTokensPerS is the most output tokens (messages with a
	// choice) in one whole second from the first request's start.
	MaxOutputTokensPerS float64
	// MaxConcurrentRequests is the most requests in flight at once.
	MaxConcurrentRequests int
	// OutputLens are the output token counts per request, 0 for a failed
	// one (vLLM's actual_output_lens).
	OutputLens []int
}

// stat computes a metric's statistics from values in seconds, as vLLM
// does: numpy's statistics of the seconds, times 1000.
func stat(values []float64, percentiles []float64) Stat {
	s := Stat{
		Mean:   pyfmt.Mean(values) * 1000,
		Median: pyfmt.Median(values) * 1000,
		Std:    pyfmt.Std(values) * 1000,
	}
	for _, p := range percentiles {
		s.Percentiles = append(s.Percentiles, [2]float64{p, pyfmt.Percentile(values, p) * 1000})
	}
	return s
}

// Calculate computes the metrics of outputs over a run of dur seconds as
// vLLM's calculate_metrics does. For a successful request:
//
//   - output tokens are usage.completion_tokens; without usage (vLLM would
//     count the generated text with its tokenizer) the number of messages
//     with a choice;
//   - input tokens are Output.PromptLen;
//   - TPOT is (latency - TTFT) / (output tokens - 1), for more than one
//     output token (else 0 when judging goodput, and left out of the TPOT
//     statistics);
//   - ITL gaps of every request are pooled.
//
// A request is good when each metric with an objective is at most that
// objective. Throughputs divide by dur.
func Calculate(outputs []Output, dur float64, percentiles []float64, goodput Goodput) Metrics {
	var m Metrics
	var ttfts, tpots, allTPOTs, itls, e2els []float64
	for _, o := range outputs {
		if !o.Success {
			m.OutputLens = append(m.OutputLens, 0)
			m.Failed++
			continue
		}
		outLen := o.OutputTokens
		if outLen == 0 {
			outLen = len(o.ITL) + 1
		}
		m.OutputLens = append(m.OutputLens, outLen)
		m.TotalInput += o.PromptLen
		tpot := 0.0
		if outLen > 1 {
			tpot = (o.Latency - o.TTFT) / float64(outLen-1)
			tpots = append(tpots, tpot)
		}
		allTPOTs = append(allTPOTs, tpot)
		itls = append(itls, o.ITL...)
		ttfts = append(ttfts, o.TTFT)
		e2els = append(e2els, o.Latency)
		m.Completed++
	}
	good := 0
	if goodput.set() {
		for i := range ttfts {
			ok := true
			if goodput.TTFT != nil && !(*goodput.TTFT/1000 >= ttfts[i]) {
				ok = false
			}
			if goodput.TPOT != nil && !(*goodput.TPOT/1000 >= allTPOTs[i]) {
				ok = false
			}
			if goodput.E2EL != nil && !(*goodput.E2EL/1000 >= e2els[i]) {
				ok = false
			}
			if ok {
				good++
			}
		}
	}
	for _, n := range m.OutputLens {
		m.TotalOutput += n
	}
	m.RequestThroughput = float64(m.Completed) / dur
	m.RequestGoodput = float64(good) / dur
	m.OutputThroughput = float64(m.TotalOutput) / dur
	m.TotalTokenThroughput = float64(m.TotalInput+m.TotalOutput) / dur
	m.TTFT = stat(ttfts, percentiles)
	m.TPOT = stat(tpots, percentiles)
	m.ITL = stat(itls, percentiles)
	m.E2EL = stat(e2els, percentiles)
	m.MaxOutputTokensPerS, m.MaxConcurrentRequests = peaks(outputs)
	return m
}

// peaks are vLLM's peak output token throughput and peak concurrency over
// the successful requests: tokens (the first at start+TTFT, each next one
// an ITL gap later) counted in one-second buckets from the earliest start,
// and the most requests whose [start, start+latency) intervals overlap.
func peaks(outputs []Output) (maxTokensPerS float64, maxConcurrent int) {
	var ok []Output
	for _, o := range outputs {
		if o.Success {
			ok = append(ok, o)
		}
	}
	if len(ok) == 0 {
		return 0, 0
	}
	minStart, maxEnd := math.Inf(1), math.Inf(-1)
	for _, o := range ok {
		minStart = min(minStart, o.StartTime)
		maxEnd = max(maxEnd, o.StartTime+o.Latency)
	}
	buckets := make([]float64, int(math.Ceil(maxEnd-minStart))+1)
	for _, o := range ok {
		t := o.StartTime + o.TTFT
		times := []float64{t}
		for _, g := range o.ITL {
			t += g
			times = append(times, t)
		}
		for _, t := range times {
			if b := int(t - minStart); b >= 0 && b < len(buckets) {
				buckets[b]++
			}
		}
	}
	maxTokensPerS = slices.Max(buckets)

	type event struct {
		t     float64
		delta int
	}
	events := make([]event, 0, 2*len(ok))
	for _, o := range ok {
		events = append(events, event{o.StartTime, 1}, event{o.StartTime + o.Latency, -1})
	}
	// A departure sorts before an arrival at the same time: the intervals
	// are half-open.
	slices.SortFunc(events, func(a, b event) int {
		if a.t != b.t {
			if a.t < b.t {
				return -1
			}
			return 1
		}
		return a.delta - b.delta
	})
	cur := 0
	for _, e := range events {
		cur += e.delta
		maxConcurrent = max(maxConcurrent, cur)
	}
	return maxTokensPerS, maxConcurrent
}
