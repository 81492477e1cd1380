package main

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// The targets pdq's hot path is held to (docs/benchmarks.md, "Against the
// targets"). make bench checks each one in the same run, against the floor
// and the baseline measured beside it, so that they hold on a noisy
// machine.
const (
	maxAddedTTFTp50   = 0.5     // ms over the floor, concurrency 1, zero-latency engines
	maxAddedTTFTp99   = 1.5     // ms
	maxCPUShare       = 1.0 / 3 // of the baseline's CPU per request
	minThroughput     = 0.65    // of the floor's req/s at concurrency 64, zero-latency engines
	maxAddedITLp99    = 0.3     // ms over the floor, 64 streams, realistic engines
	maxLongAddedTTFT  = 3.0     // ms over the floor at p50, 400 KB prompts
	maxLongAllocShare = 3.0     // bytes allocated per request, as a multiple of the body
	maxStreamsRSS     = 300     // MB of 10^6 bytes, 1,000 streams in flight
)

// eps keeps a figure that is at its bound, but for a float's rounding,
// within it.
const eps = 1e-9

// table is what one table measured: pdq's targets, and the floor.
type table struct {
	floor, base, head *result // nil: not run
	bodyBytes         float64 // a request body's mean size, where known
}

// measured is every table of a run, by profile and concurrency.
type measured map[string]map[int]table

func (m measured) add(profile string, concurrency int, t table) {
	if m[profile] == nil {
		m[profile] = make(map[int]table)
	}
	m[profile][concurrency] = t
}

// get returns the table of profile at concurrency where pdq HEAD ran,
// and the floor too when floor is set.
func (m measured) get(profile string, concurrency int, floor bool) (table, bool) {
	t, ok := m[profile][concurrency]
	if !ok || t.head == nil || floor && t.floor == nil {
		return t, false
	}
	return t, true
}

// failed says how the requests of a table that a target is read from
// failed, "" when none did: a figure from failed requests meets nothing.
func (t table) failed(floor bool) string {
	if f := failures("HEAD", t.head); f != "" || !floor {
		return f
	}
	return failures("the floor", t.floor)
}

// failures says how many of r's requests completed, when any failed or
// none completed; "" otherwise.
func failures(name string, r *result) string {
	if b := r.bench; b.Failed > 0 || b.Completed == 0 {
		return fmt.Sprintf("%s completed %d of %d", name, b.Completed, b.Completed+b.Failed)
	}
	return ""
}

// targetRow is one line of the summary.
type targetRow struct{ target, required, measured, met string }

// targetRows checks the run against the targets: one row each for what it
// measured, none for what it did not run. A row whose requests failed is
// not met, whatever its figure.
func targetRows(m measured, base string) []targetRow {
	var rows []targetRow
	add := func(failed, target, required, measured string, met bool) {
		if failed != "" {
			measured, met = failed, false
		}
		verdict := "no"
		if met {
			verdict = "yes"
		}
		rows = append(rows, targetRow{target, required, measured, verdict})
	}
	if t, ok := m.get("zero", 1, true); ok {
		p50 := t.head.bench.P50TTFT - t.floor.bench.P50TTFT
		p99 := t.head.bench.P99TTFT - t.floor.bench.P99TTFT
		add(t.failed(true), "added TTFT over the floor, concurrency 1",
			fmt.Sprintf("p50 ≤ %.1f ms, p99 ≤ %.1f ms", maxAddedTTFTp50, maxAddedTTFTp99),
			fmt.Sprintf("%+.2f ms, %+.2f ms", p50, p99), p50 <= maxAddedTTFTp50+eps && p99 <= maxAddedTTFTp99+eps)
	}
	for _, profile := range []string{"zero", "realistic", "long"} {
		var shares []string
		met, fail := true, ""
		for _, c := range slices.Sorted(maps.Keys(m[profile])) {
			t, ok := m.get(profile, c, false)
			if !ok || t.base == nil || t.base.bench.Completed == 0 || t.base.cpu <= 0 || t.head.cpu <= 0 {
				continue // nothing to compare: BASE did not run, or no CPU was read
			}
			if f := t.failed(false); f != "" && fail == "" {
				fail = fmt.Sprintf("%s at c=%d", f, c)
			}
			if t.head.bench.Completed == 0 {
				continue
			}
			share := perRequest(*t.head) / perRequest(*t.base)
			shares = append(shares, fmt.Sprintf("%.0f %% (c=%d)", 100*share, c))
			met = met && share <= maxCPUShare+eps
		}
		if fail != "" {
			shares = append(shares, fail)
			met = false
		}
		if len(shares) > 0 {
			add("", "CPU per request, "+profileShort[profile], fmt.Sprintf("≤ 1/3 of %s's", base), strings.Join(shares, ", "), met)
		}
	}
	if t, ok := m.get("zero", 64, true); ok {
		share := 0.0
		if t.floor.bench.RequestThroughput > 0 {
			share = t.head.bench.RequestThroughput / t.floor.bench.RequestThroughput
		}
		add(t.failed(true), "req/s at concurrency 64", fmt.Sprintf("≥ %.0f %% of the floor's", 100*minThroughput),
			fmt.Sprintf("%.0f %% (%.1f against %.1f)", 100*share, t.head.bench.RequestThroughput, t.floor.bench.RequestThroughput),
			share >= minThroughput-eps)
	}
	if t, ok := m.get("realistic", 64, true); ok {
		d := t.head.bench.P99ITL - t.floor.bench.P99ITL
		add(t.failed(true), "ITL p99 at 64 streams, 10 ms engine ITL", fmt.Sprintf("≤ %.1f ms over the floor's", maxAddedITLp99),
			fmt.Sprintf("%+.2f ms (the floor %.2f ms)", d, t.floor.bench.P99ITL), d <= maxAddedITLp99+eps)
	}
	if t, ok := m.get("long", 1, true); ok {
		p50 := t.head.bench.P50TTFT - t.floor.bench.P50TTFT
		p99 := t.head.bench.P99TTFT - t.floor.bench.P99TTFT
		add(t.failed(true), "long prompt: added TTFT", fmt.Sprintf("p50 ≤ %.0f ms", maxLongAddedTTFT),
			fmt.Sprintf("%+.2f ms p50 (%+.2f ms p99)", p50, p99), p50 <= maxLongAddedTTFT+eps)
	}
	if t, ok := m.get("long", 1, false); ok && t.head.alloc > 0 && t.bodyBytes > 0 {
		per := 0.0
		if t.head.bench.Completed > 0 {
			per = t.head.alloc / float64(t.head.bench.Completed)
		}
		add(t.failed(false), "long prompt: allocations", fmt.Sprintf("≤ %.0f× the body", maxLongAllocShare),
			fmt.Sprintf("%.0f KiB a request, %.1f× a %.0f KiB body (the whole process)", per/1024, per/t.bodyBytes, t.bodyBytes/1024),
			per <= maxLongAllocShare*t.bodyBytes*(1+eps))
	}
	if t, ok := m.get("streams", 1000, false); ok {
		add(t.failed(false), "peak RSS of pdq up, 1,000 streams", fmt.Sprintf("≤ %d MB", maxStreamsRSS),
			fmt.Sprintf("%.0f MB (%.0f MiB)", float64(t.head.rss)/1e6, float64(t.head.rss)/(1<<20)),
			t.head.rss <= maxStreamsRSS*1e6)
	}
	return rows
}

var profileShort = map[string]string{"zero": "zero-latency engines", "realistic": "realistic engines", "long": "400 KB prompts"}

// perRequest is a result's CPU per completed request, in seconds.
func perRequest(r result) float64 { return r.cpu.Seconds() / float64(r.bench.Completed) }

func printTargets(m measured, base string) {
	rows := targetRows(m, base)
	if len(rows) == 0 {
		return
	}
	fmt.Printf("\n## Against the targets (HEAD, in this run)\n\n")
	fmt.Println("| target | required | measured | met |")
	fmt.Println("|---|---|---|---|")
	for _, r := range rows {
		fmt.Printf("| %s | %s | %s | %s |\n", r.target, r.required, r.measured, r.met)
	}
}
