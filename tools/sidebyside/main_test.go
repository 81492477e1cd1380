package main

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestMedianResult(t *testing.T) {
	run := func(ttft, rps float64, cpu time.Duration, completed, failed int) result {
		return result{bench: bench{P50TTFT: ttft, RequestThroughput: rps, Completed: completed, Failed: failed}, cpu: cpu}
	}
	for _, tc := range []struct {
		name string
		rs   []result
		want result
	}{
		{"one run is itself", []result{run(3, 100, time.Second, 10, 0)}, run(3, 100, time.Second, 10, 0)},
		{"three runs: the middle of each column", []result{run(9, 100, 3*time.Second, 10, 0), run(1, 300, time.Second, 10, 0), run(4, 200, 2*time.Second, 10, 0)},
			run(4, 200, 2*time.Second, 10, 0)},
		{"two runs: the mean of the middle two", []result{run(2, 100, time.Second, 10, 0), run(4, 300, 3*time.Second, 10, 0)},
			run(3, 200, 2*time.Second, 10, 0)},
		{"a run's failures show", []result{run(1, 1, time.Second, 10, 0), run(1, 1, time.Second, 8, 2), run(1, 1, time.Second, 10, 0)},
			run(1, 1, time.Second, 8, 2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := medianResult(tc.rs); got != tc.want {
				t.Errorf("medianResult = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestTargetRows(t *testing.T) {
	res := func(ttft50, ttft99, itl99, rps float64, cpu time.Duration, rss int64, alloc float64) *result {
		return &result{bench: bench{Completed: 100, P50TTFT: ttft50, P99TTFT: ttft99, P99ITL: itl99, RequestThroughput: rps},
			cpu: cpu, rss: rss, alloc: alloc}
	}
	const body = 400 << 10
	// Every figure at its bound: all met. The plain proxy's are HEAD's
	// but for the checks below.
	atBounds := func() measured {
		m := measured{}
		both := func(floor, base, head *result) table {
			px := *head
			return table{floor: floor, proxy: &px, base: base, head: head}
		}
		m.add("zero", 1, both(res(1, 2, 0, 500, 0, 0, 0), res(3, 5, 0, 200, 300*time.Millisecond, 0, 0),
			res(1.5, 3.5, 0, 300, 100*time.Millisecond, 0, 0)))
		m.add("zero", 64, both(res(1, 2, 0, 1000, 0, 0, 0), res(3, 5, 0, 400, 330*time.Millisecond, 0, 0),
			res(2, 3, 0, 650, 110*time.Millisecond, 0, 0)))
		m.add("realistic", 64, both(res(200, 210, 16, 100, 0, 0, 0), res(210, 220, 20, 100, 30*time.Millisecond, 0, 0),
			res(205, 215, 16.3, 100, 10*time.Millisecond, 0, 0)))
		long := both(res(50, 60, 0, 15, 0, 0, 0), res(100, 120, 0, 9, 6*time.Second, 0, 0), res(53, 70, 0, 14, 2*time.Second, 0, 100*3*body))
		long.bodyBytes = body
		m.add("long", 1, long)
		// The streams profile runs pdq only: no floor, no proxy.
		m.add("streams", 1000, table{base: res(0, 0, 0, 60, time.Second, 200e6, 0), head: res(0, 0, 0, 70, time.Second, 300e6, 0)})
		return m
	}
	want := []targetRow{
		{"added TTFT over the floor, concurrency 1", "p50 ≤ 0.5 ms, p99 ≤ 1.5 ms", "+0.50 ms, +1.50 ms", "yes", "+0.50 ms, +1.50 ms (yes)"},
		{"CPU per request, zero-latency engines", "≤ 1/3 of base's", "33 % (c=1), 33 % (c=64)", "yes", "33 % (c=1), 33 % (c=64) (yes)"},
		{"CPU per request, realistic engines", "≤ 1/3 of base's", "33 % (c=64)", "yes", "33 % (c=64) (yes)"},
		{"CPU per request, 400 KB prompts", "≤ 1/3 of base's", "33 % (c=1)", "yes", "33 % (c=1) (yes)"},
		{"req/s at concurrency 64", "≥ 65 % of the floor's", "65 % (650.0 against 1000.0)", "yes", "65 % (650.0 against 1000.0) (yes)"},
		{"ITL p99 at 64 streams, 10 ms engine ITL", "≤ 0.3 ms over the floor's", "+0.30 ms (the floor 16.00 ms)", "yes", "+0.30 ms (the floor 16.00 ms) (yes)"},
		{"long prompt: added TTFT", "p50 ≤ 3 ms", "+3.00 ms p50 (+10.00 ms p99)", "yes", "+3.00 ms p50 (+10.00 ms p99) (yes)"},
		{"long prompt: allocations", "≤ 3× the body", "1200 KiB a request, 3.0× a 400 KiB body (the whole process)", "yes", "-"},
		{"peak RSS of pdq up, 1,000 streams", "≤ 300 MB", "300 MB (286 MiB)", "yes", "-"},
	}
	got := targetRows(atBounds(), "base")
	if len(got) != len(want) {
		t.Fatalf("%d rows, want %d: %q", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("row %d:\n got %q\nwant %q", i, got[i], want[i])
		}
	}

	// Each figure just past its bound fails its row, and only its row; a
	// table's failed requests fail every row read from it.
	for _, tc := range []struct {
		name string
		rows []int
		past func(m measured)
	}{
		{"TTFT p50", []int{0}, func(m measured) { m["zero"][1].head.bench.P50TTFT += 0.01 }},
		{"TTFT p99", []int{0}, func(m measured) { m["zero"][1].head.bench.P99TTFT += 0.01 }},
		{"CPU at one concurrency", []int{1}, func(m measured) { m["zero"][64].head.cpu += time.Millisecond }},
		{"CPU, realistic", []int{2}, func(m measured) { m["realistic"][64].head.cpu += time.Millisecond }},
		{"throughput", []int{4}, func(m measured) { m["zero"][64].head.bench.RequestThroughput -= 0.1 }},
		{"ITL p99", []int{5}, func(m measured) { m["realistic"][64].head.bench.P99ITL += 0.01 }},
		{"long prompt TTFT", []int{6}, func(m measured) { m["long"][1].head.bench.P50TTFT += 0.01 }},
		{"long prompt allocations", []int{7}, func(m measured) { m["long"][1].head.alloc += 1000 }},
		{"RSS", []int{8}, func(m measured) { m["streams"][1000].head.rss++ }},
		{"failed requests", []int{3, 6, 7}, func(m measured) { m["long"][1].head.bench.Failed = 1 }},
		{"the floor's failed requests", []int{5}, func(m measured) { m["realistic"][64].floor.bench.Failed = 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := atBounds()
			tc.past(m)
			for i, r := range targetRows(m, "base") {
				if wantMet := !slices.Contains(tc.rows, i); (r.met == "yes") != wantMet {
					t.Errorf("row %d (%s): met %s with %s", i, r.target, r.met, r.measured)
				}
			}
		})
	}

	// The plain proxy's figure past its bound fails its verdict, and
	// only its own: HEAD's rows stay met.
	for _, tc := range []struct {
		name string
		rows []int
		past func(m measured)
	}{
		{"TTFT p99", []int{0}, func(m measured) { m["zero"][1].proxy.bench.P99TTFT += 0.01 }},
		{"CPU", []int{1}, func(m measured) { m["zero"][1].proxy.cpu += time.Millisecond }},
		{"throughput", []int{4}, func(m measured) { m["zero"][64].proxy.bench.RequestThroughput -= 0.1 }},
		{"ITL p99", []int{5}, func(m measured) { m["realistic"][64].proxy.bench.P99ITL += 0.01 }},
		{"long prompt TTFT", []int{6}, func(m measured) { m["long"][1].proxy.bench.P50TTFT += 0.01 }},
		{"failed requests", []int{3, 6}, func(m measured) { m["long"][1].proxy.bench.Failed = 1 }},
		{"the floor's failed requests", []int{5}, func(m measured) { m["realistic"][64].floor.bench.Failed = 2 }},
	} {
		t.Run("proxy "+tc.name, func(t *testing.T) {
			m := atBounds()
			tc.past(m)
			for i, r := range targetRows(m, "base") {
				wantMet := !slices.Contains(tc.rows, i)
				if r.proxy != "-" && strings.HasSuffix(r.proxy, "(yes)") != wantMet {
					t.Errorf("row %d (%s): the proxy %s", i, r.target, r.proxy)
				}
				// The floor's failures fail HEAD's row too (row 5); nothing
				// else of the proxy's touches HEAD's verdicts.
				headMet := tc.name != "the floor's failed requests" || i != 5
				if (r.met == "yes") != headMet {
					t.Errorf("row %d (%s): HEAD met %s with %s", i, r.target, r.met, r.measured)
				}
			}
		})
	}

	// What a run did not measure has no row: a table without the floor
	// checks nothing against it.
	m := measured{}
	m.add("zero", 1, table{base: res(3, 5, 0, 200, 300*time.Millisecond, 0, 0), head: res(1.4, 3.6, 0, 300, 100*time.Millisecond, 0, 0)})
	if got := targetRows(m, "base"); len(got) != 1 || got[0].target != "CPU per request, zero-latency engines" {
		t.Errorf("without a floor: %q, want the CPU row alone", got)
	}
}

func TestTableOf(t *testing.T) {
	rs := []result{{rss: 0}, {rss: 1}, {rss: 2}, {rss: 3}, {rss: 4}}
	if tb := tableOf(rs, false); tb.floor.rss != 1 || tb.proxy.rss != 2 || tb.base.rss != 3 || tb.head.rss != 4 {
		t.Errorf("five targets: floor %d, proxy %d, base %d, head %d; want 1, 2, 3, 4", tb.floor.rss, tb.proxy.rss, tb.base.rss, tb.head.rss)
	}
	if tb := tableOf(rs[3:], true); tb.floor != nil || tb.proxy != nil || tb.base.rss != 3 || tb.head.rss != 4 {
		t.Errorf("pdq only: floor %v, proxy %v, base %d, head %d; want none, none, 3, 4", tb.floor, tb.proxy, tb.base.rss, tb.head.rss)
	}
}
