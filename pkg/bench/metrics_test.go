package bench

import (
	"math"
	"strings"
	"testing"
)

// timelines are four requests with hand-made timelines (seconds):
//
//	A  start 0,    first token 0.1, then gaps 0.1 0.1 0.2, end 0.5, 4 tokens, 10 in
//	B  start 0.25, first token 0.25 (its only one), end 0.5,     1 token,  20 in
//	C  failed
//	D  start 0.5,  first token 0.6, then gaps 0.1 0.1, end 1.4,  3 tokens,  5 in
//
// A and B overlap, and B ends as D starts: two at once, not three, since
// vLLM's intervals are half-open. Second 0 holds A's four tokens and B's.
func timelines() []Output {
	return []Output{
		{Success: true, StartTime: 0, TTFT: 0.1, ITL: []float64{0.1, 0.1, 0.2}, Latency: 0.5, OutputTokens: 4, PromptLen: 10},
		{Success: true, StartTime: 0.25, TTFT: 0.25, Latency: 0.25, OutputTokens: 1, PromptLen: 20},
		{Success: false, PromptLen: 7, Error: "Internal Server Error"},
		{Success: true, StartTime: 0.5, TTFT: 0.6, ITL: []float64{0.1, 0.1}, Latency: 0.9, OutputTokens: 3, PromptLen: 5},
	}
}

func ptr(f float64) *float64 { return &f }

func TestCalculate(t *testing.T) {
	m := Calculate(timelines(), 2.0, []float64{50, 99}, Goodput{TTFT: ptr(300), TPOT: ptr(140)})
	ints := []struct {
		name      string
		got, want int
	}{
		{"completed", m.Completed, 3},
		{"failed", m.Failed, 1},
		{"total input", m.TotalInput, 35},
		{"total output", m.TotalOutput, 8},
		{"peak concurrency", m.MaxConcurrentRequests, 2},
	}
	for _, c := range ints {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
	// Expected statistics: numpy 1.24 on the seconds, times 1000.
	floats := []struct {
		name      string
		got, want float64
	}{
		{"request throughput", m.RequestThroughput, 1.5},
		// A is good (TTFT 100 ms, TPOT 133 ms); B is good (TPOT counts 0
		// with one token); D's TTFT of 600 ms is not.
		{"request goodput", m.RequestGoodput, 1.0},
		{"output throughput", m.OutputThroughput, 4.0},
		{"total token throughput", m.TotalTokenThroughput, 21.5},
		{"peak tokens per second", m.MaxOutputTokensPerS, 5},
		{"mean TTFT", m.TTFT.Mean, 316.66666666666663},
		{"median TTFT", m.TTFT.Median, 250},
		{"std TTFT", m.TTFT.Std, 209.4967514996089},
		{"p99 TTFT", m.TTFT.Percentiles[1][1], 593.0},
		// TPOT = (E2EL - TTFT) / (tokens - 1): A 0.4/3, D 0.3/2; B has one
		// token and no TPOT.
		{"mean TPOT", m.TPOT.Mean, 141.66666666666666},
		{"std TPOT", m.TPOT.Std, 8.333333333333345},
		{"p99 TPOT", m.TPOT.Percentiles[1][1], 149.83333333333334},
		// ITL pools A's and D's gaps.
		{"mean ITL", m.ITL.Mean, 120.0},
		{"median ITL", m.ITL.Median, 100.0},
		{"std ITL", m.ITL.Std, 40.0},
		{"p99 ITL", m.ITL.Percentiles[1][1], 196.0},
		{"mean E2EL", m.E2EL.Mean, 549.9999999999999},
		{"std E2EL", m.E2EL.Std, 267.7063067368168},
		{"p99 E2EL", m.E2EL.Percentiles[1][1], 892.0},
		{"p50 E2EL", m.E2EL.Percentiles[0][1], 500.0},
	}
	for _, c := range floats {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	if got, want := m.OutputLens, []int{4, 1, 0, 3}; !equalInts(got, want) {
		t.Errorf("output lens %v, want %v", got, want)
	}
}

func TestGoodput(t *testing.T) {
	tests := []struct {
		name string
		g    Goodput
		want float64
	}{
		{"no objectives counts none", Goodput{}, 0},
		{"ttft only", Goodput{TTFT: ptr(250)}, 2},                   // A, B (250 ms is within 250 ms)
		{"tpot only", Goodput{TPOT: ptr(140)}, 2},                   // A (133 ms), B (0)
		{"e2el only", Goodput{E2EL: ptr(500)}, 2},                   // A, B
		{"all of them", Goodput{ptr(1000), ptr(100), ptr(1000)}, 1}, // B only: A's TPOT is 133 ms, D's 150 ms
		{"zero objectives", Goodput{TTFT: ptr(0)}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := Calculate(timelines(), 1.0, []float64{99}, tt.g)
			if m.RequestGoodput != tt.want {
				t.Errorf("goodput %v, want %v", m.RequestGoodput, tt.want)
			}
		})
	}
}

func TestCalculateWithoutUsageCountsChunks(t *testing.T) {
	m := Calculate([]Output{{Success: true, TTFT: 0.1, ITL: []float64{0.1, 0.1}, Latency: 0.3}}, 1, []float64{99}, Goodput{})
	if m.TotalOutput != 3 {
		t.Errorf("output tokens without usage = %d, want 3 (one per message with a choice)", m.TotalOutput)
	}
}

func TestCalculateAllFailed(t *testing.T) {
	m := Calculate([]Output{{Error: "x"}, {Error: "y"}}, 1, []float64{99}, Goodput{})
	if m.Completed != 0 || m.Failed != 2 || m.TTFT.Mean != 0 || m.TTFT.Percentiles[0][1] != 0 || m.MaxConcurrentRequests != 0 {
		t.Errorf("all failed: %+v", m)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// golden is what vLLM's serve.py prints for the timelines above (run
// through Python's format with numpy's statistics), with
// --max-concurrency 4 --request-rate 10 --goodput ... --metric-percentiles
// 50,99.9 --percentile-metrics ttft,tpot,itl,e2el and a duration of 2 s.
// Lines end in the spaces "{:<10}" pads with.
const golden = "============ Serving Benchmark Result ============\n" +
	"Successful requests:                     3         \n" +
	"Failed requests:                         1         \n" +
	"Maximum request concurrency:             4         \n" +
	"Request rate configured (RPS):           10.00     \n" +
	"Benchmark duration (s):                  2.00      \n" +
	"Total input tokens:                      35        \n" +
	"Total generated tokens:                  8         \n" +
	"Request throughput (req/s):              1.50      \n" +
	"Request goodput (req/s):                 1.00      \n" +
	"Output token throughput (tok/s):         4.00      \n" +
	"Peak output token throughput (tok/s):    5.00      \n" +
	"Peak concurrent requests:                2.00      \n" +
	"Total token throughput (tok/s):          21.50     \n" +
	"---------------Time to First Token----------------\n" +
	"Mean TTFT (ms):                          316.67    \n" +
	"Median TTFT (ms):                        250.00    \n" +
	"P50 TTFT (ms):                           250.00    \n" +
	"P99.9 TTFT (ms):                         599.30    \n" +
	"-----Time per Output Token (excl. 1st token)------\n" +
	"Mean TPOT (ms):                          141.67    \n" +
	"Median TPOT (ms):                        141.67    \n" +
	"P50 TPOT (ms):                           141.67    \n" +
	"P99.9 TPOT (ms):                         149.98    \n" +
	"---------------Inter-token Latency----------------\n" +
	"Mean ITL (ms):                           120.00    \n" +
	"Median ITL (ms):                         100.00    \n" +
	"P50 ITL (ms):                            100.00    \n" +
	"P99.9 ITL (ms):                          199.60    \n" +
	"----------------End-to-end Latency----------------\n" +
	"Mean E2EL (ms):                          550.00    \n" +
	"Median E2EL (ms):                        500.00    \n" +
	"P50 E2EL (ms):                           500.00    \n" +
	"P99.9 E2EL (ms):                         899.20    \n" +
	"==================================================\n"

func TestWriteBlockGolden(t *testing.T) {
	pcts := []float64{50, 99.9}
	r := Report{
		Metrics:           Calculate(timelines(), 2.0, pcts, Goodput{TTFT: ptr(300), TPOT: ptr(140)}),
		Duration:          2.0,
		MaxConcurrency:    4,
		RequestRate:       10,
		Goodput:           true,
		PercentileMetrics: []string{"e2el", "ttft", "tpot", "itl"}, // printed in vLLM's order whatever the order given
		Percentiles:       pcts,
		QueueTimes:        []float64{0, 0, 0}, // kept, but not printed unless asked for
	}
	var b strings.Builder
	if err := r.WriteBlock(&b); err != nil {
		t.Fatal(err)
	}
	if b.String() != golden {
		t.Errorf("block differs from vLLM's:\n got:\n%s\nwant:\n%s", b.String(), golden)
	}
}

func TestWriteBlockConditionalLines(t *testing.T) {
	r := Report{
		Metrics:           Calculate(timelines(), 1, []float64{99}, Goodput{}),
		Duration:          1,
		RequestRate:       math.Inf(1),
		PercentileMetrics: []string{"ttft"},
		Percentiles:       []float64{99},
	}
	var b strings.Builder
	if err := r.WriteBlock(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, absent := range []string{"Maximum request concurrency:", "Request rate configured", "Request goodput", "Inter-token Latency", "Mean TPOT"} {
		if strings.Contains(out, absent) {
			t.Errorf("block has %q:\n%s", absent, out)
		}
	}
	for _, present := range []string{"Failed requests:", "Peak concurrent requests:", "P99 TTFT (ms):"} {
		if !strings.Contains(out, present) {
			t.Errorf("block lacks %q:\n%s", present, out)
		}
	}
}

func TestCenter(t *testing.T) {
	tests := []struct {
		s    string
		c    byte
		n    int
		want string
	}{
		{"ab", '-', 5, "-ab--"}, // Python puts the odd one on the right
		{"abc", '=', 5, "=abc="},
		{"toolong", '-', 3, "toolong"},
	}
	for _, tt := range tests {
		if got := center(tt.s, tt.c, tt.n); got != tt.want {
			t.Errorf("center(%q, %q, %d) = %q, want %q", tt.s, tt.c, tt.n, got, tt.want)
		}
	}
}
