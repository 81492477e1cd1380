package main

import (
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
	m := measured{}
	// Concurrency 1: 0.4 ms over the floor at p50 (met), 1.6 at p99 (not).
	m.add("zero", 1, table{floor: res(1, 2, 0, 500, 0, 0, 0), base: res(3, 5, 0, 200, 300*time.Millisecond, 0, 0),
		head: res(1.4, 3.6, 0, 300, 100*time.Millisecond, 0, 0)})
	// Concurrency 64: 65 % of the floor's req/s, a third of the base's CPU.
	m.add("zero", 64, table{floor: res(1, 2, 0, 1000, 0, 0, 0), base: res(3, 5, 0, 400, 300*time.Millisecond, 0, 0),
		head: res(2, 3, 0, 650, 100*time.Millisecond, 0, 0)})
	m.add("realistic", 64, table{floor: res(200, 210, 16, 100, 0, 0, 0), base: res(210, 220, 20, 100, 400*time.Millisecond, 0, 0),
		head: res(205, 215, 16.31, 100, 200*time.Millisecond, 0, 0)})
	m.add("long", 1, table{floor: res(50, 60, 0, 15, 0, 0, 0), base: res(100, 120, 0, 9, 6*time.Second, 0, 0),
		head: res(53, 70, 0, 14, time.Second, 0, 100*3*330<<10), bodyBytes: 330 << 10})
	// The streams profile runs pdq only: no floor.
	m.add("streams", 1000, table{base: res(0, 0, 0, 60, time.Second, 200<<20, 0), head: res(0, 0, 0, 70, time.Second, 301<<20, 0)})

	want := []targetRow{
		{"added TTFT over the floor, concurrency 1", "p50 ≤ 0.5 ms, p99 ≤ 1.5 ms", "+0.40 ms, +1.60 ms", "no"},
		{"CPU per request, zero-latency engines", "≤ 1/3 of base's", "33 % (c=1), 33 % (c=64)", "yes"},
		{"CPU per request, realistic engines", "≤ 1/3 of base's", "50 % (c=64)", "no"},
		{"CPU per request, 400 KB prompts", "≤ 1/3 of base's", "17 % (c=1)", "yes"},
		{"req/s at concurrency 64", "≥ 65 % of the floor's", "65 % (650.0 against 1000.0)", "yes"},
		{"ITL p99 at 64 streams, 10 ms engine ITL", "≤ 0.3 ms over the floor's", "+0.31 ms (the floor 16.00 ms)", "no"},
		{"400 KB prompt: added TTFT", "≤ 3 ms", "+3.00 ms p50, +10.00 ms p99", "yes"},
		{"400 KB prompt: allocations", "≤ 3× the body", "990 KB a request, 3.0× a 330 KB body (the whole process)", "yes"},
		{"peak RSS of pdq up, 1,000 streams", "≤ 300 MB", "301 MB", "no"},
	}
	got := targetRows(m, "base")
	if len(got) != len(want) {
		t.Fatalf("%d rows, want %d: %q", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("row %d:\n got %q\nwant %q", i, got[i], want[i])
		}
	}

	// What a run did not measure has no row: a table without the floor
	// checks nothing against it.
	m = measured{}
	m.add("zero", 1, table{base: res(3, 5, 0, 200, 300*time.Millisecond, 0, 0), head: res(1.4, 3.6, 0, 300, 100*time.Millisecond, 0, 0)})
	if got := targetRows(m, "base"); len(got) != 1 || got[0].target != "CPU per request, zero-latency engines" {
		t.Errorf("without a floor: %q, want the CPU row alone", got)
	}
}
