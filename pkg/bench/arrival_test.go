package bench

import (
	"math"
	"testing"

	"github.com/pdq-dev/pdq/pkg/bench/pyfmt"
)

// closeTo allows for the C library's log and pow differing from Go's in
// the last bit.
func closeTo(got, want float64) bool {
	return math.Abs(got-want) <= 1e-12*math.Max(1, math.Abs(want))
}

func TestGammaMatchesNumpy(t *testing.T) {
	// np.random.seed(0); then, in turn, np.random.gamma(1.0, 0.5),
	// np.random.gamma(0.5, 2.0), np.random.gamma(3.0, 0.1): the three
	// samplers (exponential, shape below 1, Marsaglia-Tsang).
	rs := newRandomState(0)
	want := []struct{ shape, scale, value float64 }{
		{1.0, 0.5, 0.397937254081555},
		{0.5, 2.0, 1.2211462627186978},
		{3.0, 0.1, 0.04128969900212638},
	}
	for _, w := range want {
		if got := rs.gamma(w.shape, w.scale); !closeTo(got, w.value) {
			t.Errorf("gamma(%v, %v) = %v, want numpy's %v", w.shape, w.scale, got, w.value)
		}
	}
	// np.random.seed(0); np.random.rand() is the well-known 0.5488135039273248.
	if got := newRandomState(0).double(); got != 0.5488135039273248 {
		t.Errorf("first double of seed 0 = %v, want 0.5488135039273248", got)
	}
}

func TestDelays(t *testing.T) {
	inf := math.Inf(1)
	tests := []struct {
		name             string
		n                int
		rate, burstiness float64
		seed             uint32
		want             []float64
	}{
		// vLLM's get_request, run with numpy 1.24 after np.random.seed(seed).
		{"poisson", 6, 4, 1, 0, []float64{0.2230824511221632, 0.5751179921131646, 0.8338960785906834, 1.0545474008581102, 1.2090054803918748, 1.5}},
		{"bursty", 6, 10, 0.5, 42, []float64{0.06995554249898323, 0.3985972961756827, 0.4107361706125579, 0.4124185838422405, 0.5997886969114562, 0.6}},
		{"regular", 6, 2, 3, 7, []float64{0.32443639707618893, 0.582999982101329, 1.021419705772163, 1.7927650838465834, 2.412189621926803, 3.0}},
		{"rate inf sends all at 0", 4, inf, 1, 0, []float64{0, 0, 0, 0}},
		{"burstiness inf gives constant gaps", 4, 4, inf, 0, []float64{0.25, 0.5, 0.75, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Delays(tt.n, tt.rate, tt.burstiness, tt.seed)
			if len(got) != len(tt.want) {
				t.Fatalf("got %d delays, want %d", len(got), len(tt.want))
			}
			for i := range got {
				if !closeTo(got[i], tt.want[i]) {
					t.Errorf("delay %d = %v, want %v", i, got[i], tt.want[i])
				}
			}
		})
	}
}

func TestDelaysLastIsNOverRate(t *testing.T) {
	for _, b := range []float64{0.25, 1, 4} {
		for _, seed := range []uint32{0, 1, 12345} {
			d := Delays(1000, 7, b, seed)
			if last, want := d[len(d)-1], 1000.0/7; !closeTo(last, want) {
				t.Errorf("burstiness %v seed %d: last delay %v, want %v", b, seed, last, want)
			}
			for i := 1; i < len(d); i++ {
				if d[i] < d[i-1] {
					t.Fatalf("burstiness %v seed %d: delays go back at %d", b, seed, i)
				}
			}
		}
	}
}

func TestGammaGapMoments(t *testing.T) {
	// Gaps drawn as vLLM draws them have mean 1/rate and variance
	// 1/(rate^2 * burstiness) before the rescaling.
	const n, rate = 200000, 5.0
	for _, b := range []float64{0.5, 1, 3} {
		rs := newRandomState(1)
		gaps := make([]float64, n)
		for i := range gaps {
			gaps[i] = rs.gamma(b, 1/(rate*b))
		}
		mean, sd := pyfmt.Mean(gaps), pyfmt.Std(gaps)
		if math.Abs(mean-1/rate)/(1/rate) > 0.02 {
			t.Errorf("burstiness %v: mean gap %v, want about %v", b, mean, 1/rate)
		}
		wantSD := 1 / (rate * math.Sqrt(b))
		if math.Abs(sd-wantSD)/wantSD > 0.03 {
			t.Errorf("burstiness %v: gap std %v, want about %v", b, sd, wantSD)
		}
	}
}
