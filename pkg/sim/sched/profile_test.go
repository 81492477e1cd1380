package sched

import (
	"math"
	"testing"
	"time"
)

// TestSeedCalibration runs the seed's benchmark through the seed profile
// in virtual time and checks the figures of both measured runs, within
// 20 %.
func TestSeedCalibration(t *testing.T) {
	arr := RandomArrivals(200, 8000, 200, 1, 100, Seed.Config.BlockSize, 0)
	pd := Seed.PD(2 * time.Millisecond)
	good, err := pd.Run(arr)
	if err != nil {
		t.Fatal(err)
	}
	pd.Recompute = true
	broken, err := pd.Run(arr)
	if err != nil {
		t.Fatal(err)
	}
	g, b := Summarize(good), Summarize(broken)
	var end time.Duration
	for i, o := range broken {
		end = max(end, arr[i].At+o.E2E)
	}
	t.Logf("KV read: TTFT mean %.0f ms, TPOT mean %.2f ms", g.MeanTTFT, g.MeanTPOT)
	t.Logf("recompute: TTFT mean %.0f ms, TPOT mean %.1f ms, run %.0f s", b.MeanTTFT, b.MeanTPOT, end.Seconds())
	for _, c := range []struct {
		what      string
		got, want float64
	}{
		{"TTFT mean with the KV read, ms", g.MeanTTFT, 1256},
		{"TPOT mean with the KV read, ms", g.MeanTPOT, 9.0},
		{"TTFT mean when decode recomputes, ms", b.MeanTTFT, 14000},
		{"run length when decode recomputes, s", end.Seconds(), 236},
	} {
		if math.Abs(c.got-c.want) > 0.2*c.want {
			t.Errorf("%s: %.1f, want %.1f ± 20 %%", c.what, c.got, c.want)
		}
	}
	for _, o := range good {
		if o.Cached != 8000 {
			t.Fatalf("a decode leg computed %d of its prompt, want it all read", 8000-o.Cached)
		}
	}
}
