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
	maxStreamsRSS     = 300     // MB, 1,000 streams in flight
)

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

// get returns the table of profile at concurrency whose pdq HEAD ran, and
// whose floor did when floor is set.
func (m measured) get(profile string, concurrency int, floor bool) (table, bool) {
	t, ok := m[profile][concurrency]
	if !ok || t.head == nil || t.head.bench.Completed == 0 {
		return t, false
	}
	if floor && (t.floor == nil || t.floor.bench.Completed == 0) {
		return t, false
	}
	return t, true
}

// targetRow is one line of the summary.
type targetRow struct{ target, required, measured, met string }

// targetRows checks the run against the targets: one row each for what it
// measured, none for what it did not run.
func targetRows(m measured, base string) []targetRow {
	var rows []targetRow
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	if t, ok := m.get("zero", 1, true); ok {
		p50 := t.head.bench.P50TTFT - t.floor.bench.P50TTFT
		p99 := t.head.bench.P99TTFT - t.floor.bench.P99TTFT
		rows = append(rows, targetRow{"added TTFT over the floor, concurrency 1",
			fmt.Sprintf("p50 ≤ %.1f ms, p99 ≤ %.1f ms", maxAddedTTFTp50, maxAddedTTFTp99),
			fmt.Sprintf("%+.2f ms, %+.2f ms", p50, p99), yes(p50 <= maxAddedTTFTp50 && p99 <= maxAddedTTFTp99)})
	}
	for _, profile := range []string{"zero", "realistic", "long"} {
		var shares []string
		met := true
		for _, c := range slices.Sorted(maps.Keys(m[profile])) {
			t, ok := m.get(profile, c, false)
			if !ok || t.base == nil || t.base.bench.Completed == 0 || t.base.cpu <= 0 {
				continue
			}
			share := perRequest(*t.head) / perRequest(*t.base)
			shares = append(shares, fmt.Sprintf("%.0f %% (c=%d)", 100*share, c))
			met = met && share <= maxCPUShare
		}
		if len(shares) > 0 {
			rows = append(rows, targetRow{"CPU per request, " + profileShort[profile],
				fmt.Sprintf("≤ 1/3 of %s's", base), strings.Join(shares, ", "), yes(met)})
		}
	}
	if t, ok := m.get("zero", 64, true); ok && t.floor.bench.RequestThroughput > 0 {
		share := t.head.bench.RequestThroughput / t.floor.bench.RequestThroughput
		rows = append(rows, targetRow{"req/s at concurrency 64", fmt.Sprintf("≥ %.0f %% of the floor's", 100*minThroughput),
			fmt.Sprintf("%.0f %% (%.1f against %.1f)", 100*share, t.head.bench.RequestThroughput, t.floor.bench.RequestThroughput),
			yes(share >= minThroughput)})
	}
	if t, ok := m.get("realistic", 64, true); ok {
		d := t.head.bench.P99ITL - t.floor.bench.P99ITL
		rows = append(rows, targetRow{"ITL p99 at 64 streams, 10 ms engine ITL", fmt.Sprintf("≤ %.1f ms over the floor's", maxAddedITLp99),
			fmt.Sprintf("%+.2f ms (the floor %.2f ms)", d, t.floor.bench.P99ITL), yes(d <= maxAddedITLp99)})
	}
	if t, ok := m.get("long", 1, true); ok {
		p50 := t.head.bench.P50TTFT - t.floor.bench.P50TTFT
		p99 := t.head.bench.P99TTFT - t.floor.bench.P99TTFT
		rows = append(rows, targetRow{"400 KB prompt: added TTFT", fmt.Sprintf("≤ %.0f ms", maxLongAddedTTFT),
			fmt.Sprintf("%+.2f ms p50, %+.2f ms p99", p50, p99), yes(p50 <= maxLongAddedTTFT)})
	}
	if t, ok := m.get("long", 1, false); ok && t.head.alloc > 0 && t.bodyBytes > 0 {
		per := t.head.alloc / float64(t.head.bench.Completed)
		rows = append(rows, targetRow{"400 KB prompt: allocations", fmt.Sprintf("≤ %.0f× the body", maxLongAllocShare),
			fmt.Sprintf("%.0f KB a request, %.1f× a %.0f KB body (the whole process)", per/1024, per/t.bodyBytes, t.bodyBytes/1024),
			yes(per <= maxLongAllocShare*t.bodyBytes)})
	}
	if t, ok := m.get("streams", 1000, false); ok {
		mb := float64(t.head.rss) / (1 << 20)
		rows = append(rows, targetRow{"peak RSS of pdq up, 1,000 streams", fmt.Sprintf("≤ %d MB", maxStreamsRSS),
			fmt.Sprintf("%.0f MB", mb), yes(mb <= maxStreamsRSS)})
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
