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

// table is what one table measured: pdq's targets, the floor, and the
// plain proxy.
type table struct {
	floor, proxy, base, head *result // nil: not run
	bodyBytes                float64 // a request body's mean size, where known
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
func (t table) failed(floor bool) string { return t.failedAs("HEAD", t.head, floor) }

// failedAs is failed for the router r, named name.
func (t table) failedAs(name string, r *result, floor bool) string {
	if f := failures(name, r); f != "" || !floor {
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

// targetRow is one line of the summary: HEAD's figure and verdict, and
// the plain proxy's beside them where the run measured it ("-" where not).
type targetRow struct{ target, required, measured, met, proxy string }

// figure is one target's figure for a router's result in a table, and
// whether it meets the target.
type figure func(r *result) (string, bool)

// targetRows checks the run against the targets: one row each for what it
// measured, none for what it did not run. A row whose requests failed is
// not met, whatever its figure. The plain proxy is held to the same
// figures, to show which targets a router with no queue meets here.
func targetRows(m measured, base string) []targetRow {
	var rows []targetRow
	// add appends t's row: HEAD's figure, and the proxy's when t has one
	// and the figure reads one (proxy false: it does not).
	add := func(t table, floor, proxy bool, target, required string, fig figure) {
		measured, met := fig(t.head)
		if f := t.failed(floor); f != "" {
			measured, met = f, false
		}
		px := "-"
		if proxy && t.proxy != nil {
			s, ok := fig(t.proxy)
			if f := t.failedAs("the proxy", t.proxy, floor); f != "" {
				s, ok = f, false
			}
			px = s + " (" + verdict(ok) + ")"
		}
		rows = append(rows, targetRow{target, required, measured, verdict(met), px})
	}
	if t, ok := m.get("zero", 1, true); ok {
		add(t, true, true, "added TTFT over the floor, concurrency 1",
			fmt.Sprintf("p50 ≤ %.1f ms, p99 ≤ %.1f ms", maxAddedTTFTp50, maxAddedTTFTp99), func(r *result) (string, bool) {
				p50 := r.bench.P50TTFT - t.floor.bench.P50TTFT
				p99 := r.bench.P99TTFT - t.floor.bench.P99TTFT
				return fmt.Sprintf("%+.2f ms, %+.2f ms", p50, p99), p50 <= maxAddedTTFTp50+eps && p99 <= maxAddedTTFTp99+eps
			})
	}
	for _, profile := range []string{"zero", "realistic", "long"} {
		head, met, ok := cpuShares(m, profile, "HEAD", func(t table) *result { return t.head })
		if !ok {
			continue
		}
		px := "-"
		if s, pmet, ok := cpuShares(m, profile, "the proxy", func(t table) *result { return t.proxy }); ok {
			px = s + " (" + verdict(pmet) + ")"
		}
		rows = append(rows, targetRow{"CPU per request, " + profileShort[profile], fmt.Sprintf("≤ 1/3 of %s's", base), head, verdict(met), px})
	}
	if t, ok := m.get("zero", 64, true); ok {
		add(t, true, true, "req/s at concurrency 64", fmt.Sprintf("≥ %.0f %% of the floor's", 100*minThroughput), func(r *result) (string, bool) {
			share := 0.0
			if t.floor.bench.RequestThroughput > 0 {
				share = r.bench.RequestThroughput / t.floor.bench.RequestThroughput
			}
			return fmt.Sprintf("%.0f %% (%.1f against %.1f)", 100*share, r.bench.RequestThroughput, t.floor.bench.RequestThroughput),
				share >= minThroughput-eps
		})
	}
	if t, ok := m.get("realistic", 64, true); ok {
		add(t, true, true, "ITL p99 at 64 streams, 10 ms engine ITL", fmt.Sprintf("≤ %.1f ms over the floor's", maxAddedITLp99), func(r *result) (string, bool) {
			d := r.bench.P99ITL - t.floor.bench.P99ITL
			return fmt.Sprintf("%+.2f ms (the floor %.2f ms)", d, t.floor.bench.P99ITL), d <= maxAddedITLp99+eps
		})
	}
	if t, ok := m.get("long", 1, true); ok {
		add(t, true, true, "long prompt: added TTFT", fmt.Sprintf("p50 ≤ %.0f ms", maxLongAddedTTFT), func(r *result) (string, bool) {
			p50 := r.bench.P50TTFT - t.floor.bench.P50TTFT
			p99 := r.bench.P99TTFT - t.floor.bench.P99TTFT
			return fmt.Sprintf("%+.2f ms p50 (%+.2f ms p99)", p50, p99), p50 <= maxLongAddedTTFT+eps
		})
	}
	// The proxy has no /metrics: its allocations are not read.
	if t, ok := m.get("long", 1, false); ok && t.head.alloc > 0 && t.bodyBytes > 0 {
		add(t, false, false, "long prompt: allocations", fmt.Sprintf("≤ %.0f× the body", maxLongAllocShare), func(r *result) (string, bool) {
			per := 0.0
			if r.bench.Completed > 0 {
				per = r.alloc / float64(r.bench.Completed)
			}
			return fmt.Sprintf("%.0f KiB a request, %.1f× a %.0f KiB body (the whole process)", per/1024, per/t.bodyBytes, t.bodyBytes/1024),
				per <= maxLongAllocShare*t.bodyBytes*(1+eps)
		})
	}
	if t, ok := m.get("streams", 1000, false); ok {
		add(t, false, false, "peak RSS of pdq up, 1,000 streams", fmt.Sprintf("≤ %d MB", maxStreamsRSS), func(r *result) (string, bool) {
			return fmt.Sprintf("%.0f MB (%.0f MiB)", float64(r.rss)/1e6, float64(r.rss)/(1<<20)), r.rss <= maxStreamsRSS*1e6
		})
	}
	return rows
}

// cpuShares is the CPU per request of the router pick takes from each of
// profile's tables (name in a failure), as a share of BASE's beside it: the shares, whether
// all are within the target, and whether any table had one to give. A
// table whose requests failed meets nothing.
func cpuShares(m measured, profile, name string, pick func(table) *result) (string, bool, bool) {
	var shares []string
	met, fail := true, ""
	for _, c := range slices.Sorted(maps.Keys(m[profile])) {
		t := m[profile][c]
		r := pick(t)
		if r == nil || t.base == nil || t.base.bench.Completed == 0 || t.base.cpu <= 0 || r.cpu <= 0 {
			continue // nothing to compare: BASE or the router did not run, or no CPU was read
		}
		if f := failures(name, r); f != "" && fail == "" {
			fail = fmt.Sprintf("%s at c=%d", f, c)
		}
		if r.bench.Completed == 0 {
			continue
		}
		share := perRequest(*r) / perRequest(*t.base)
		shares = append(shares, fmt.Sprintf("%.0f %% (c=%d)", 100*share, c))
		met = met && share <= maxCPUShare+eps
	}
	if fail != "" {
		shares = append(shares, fail)
		met = false
	}
	return strings.Join(shares, ", "), met, len(shares) > 0
}

func verdict(met bool) string {
	if met {
		return "yes"
	}
	return "no"
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
	fmt.Println("| target | required | measured | met | the plain proxy (met) |")
	fmt.Println("|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Printf("| %s | %s | %s | %s | %s |\n", r.target, r.required, r.measured, r.met, r.proxy)
	}
}
