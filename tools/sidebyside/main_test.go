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
