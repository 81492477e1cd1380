package bench

import "math"

// Delays are the send times of n requests, in seconds from the start of
// the run, as vLLM's serve.py get_request computes them without a ramp-up:
//
//   - rate +Inf: every request at 0;
//   - burstiness +Inf: gaps of exactly 1/rate;
//   - otherwise gaps drawn from Gamma(shape=burstiness,
//     scale=1/(rate*burstiness)), so burstiness 1 is a Poisson process.
//
// The gaps are summed, then, unless the last sum is 0, scaled so that the
// last send time is exactly n/rate (vLLM does this to keep the throughput of
// runs with different seeds comparable). As in vLLM the first request
// waits for its own gap too.
//
// The gaps come from numpy's legacy RandomState seeded with seed, which is
// what vLLM's np.random.seed(args.seed) and np.random.gamma use: the same
// seed gives the same schedule as vLLM's, to within the rounding of the C
// library's log and pow.
func Delays(n int, rate, burstiness float64, seed uint32) []float64 {
	d := make([]float64, n)
	if n == 0 || math.IsInf(rate, 1) {
		return d
	}
	rs := newRandomState(seed)
	for i := range d {
		if math.IsInf(burstiness, 1) {
			d[i] = 1.0 / rate
		} else {
			theta := 1.0 / (rate * burstiness)
			d[i] = rs.gamma(burstiness, theta)
		}
	}
	for i := 1; i < n; i++ {
		d[i] += d[i-1]
	}
	if d[n-1] != 0 {
		factor := float64(n) / rate / d[n-1]
		for i := range d {
			d[i] *= factor
		}
	}
	return d
}

// randomState is numpy's legacy RandomState: MT19937 with numpy's
// next_double and the legacy Gaussian and gamma samplers
// (numpy/random/src/legacy/legacy-distributions.c).
type randomState struct {
	mt       [624]uint32
	pos      int
	hasGauss bool
	gauss    float64
}

// newRandomState is np.random.seed(seed) for a seed in [0, 2**32).
func newRandomState(seed uint32) *randomState {
	r := &randomState{}
	r.mt[0] = seed
	for i := 1; i < len(r.mt); i++ {
		r.mt[i] = 1812433253*(r.mt[i-1]^(r.mt[i-1]>>30)) + uint32(i)
	}
	r.pos = len(r.mt)
	return r
}

func (r *randomState) next32() uint32 {
	const n, m = 624, 397
	const upper, lower = 0x80000000, 0x7fffffff
	mag := [2]uint32{0, 0x9908b0df}
	if r.pos >= n {
		k := 0
		for ; k < n-m; k++ {
			y := r.mt[k]&upper | r.mt[k+1]&lower
			r.mt[k] = r.mt[k+m] ^ y>>1 ^ mag[y&1]
		}
		for ; k < n-1; k++ {
			y := r.mt[k]&upper | r.mt[k+1]&lower
			r.mt[k] = r.mt[k+m-n] ^ y>>1 ^ mag[y&1]
		}
		y := r.mt[n-1]&upper | r.mt[0]&lower
		r.mt[n-1] = r.mt[m-1] ^ y>>1 ^ mag[y&1]
		r.pos = 0
	}
	y := r.mt[r.pos]
	r.pos++
	y ^= y >> 11
	y ^= y << 7 & 0x9d2c5680
	y ^= y << 15 & 0xefc60000
	y ^= y >> 18
	return y
}

// double is numpy's mt19937 next_double: 53 random bits in [0, 1).
func (r *randomState) double() float64 {
	a := r.next32() >> 5
	b := r.next32() >> 6
	return (float64(a)*67108864.0 + float64(b)) / 9007199254740992.0
}

// gaussian is legacy_gauss: the polar method, keeping the second value.
func (r *randomState) gaussian() float64 {
	if r.hasGauss {
		r.hasGauss = false
		g := r.gauss
		r.gauss = 0
		return g
	}
	var x1, x2, r2 float64
	for {
		x1 = 2.0*r.double() - 1.0
		x2 = 2.0*r.double() - 1.0
		r2 = x1*x1 + x2*x2
		if r2 < 1.0 && r2 != 0.0 {
			break
		}
	}
	f := math.Sqrt(-2.0 * math.Log(r2) / r2)
	r.gauss = f * x1
	r.hasGauss = true
	return f * x2
}

// exponential is legacy_standard_exponential.
func (r *randomState) exponential() float64 { return -math.Log(1.0 - r.double()) }

// standardGamma is legacy_standard_gamma: exponential for shape 1, Johnk-
// style rejection below 1, Marsaglia and Tsang above.
func (r *randomState) standardGamma(shape float64) float64 {
	switch {
	case shape == 1.0:
		return r.exponential()
	case shape == 0.0:
		return 0.0
	case shape < 1.0:
		for {
			u := r.double()
			v := r.exponential()
			if u <= 1.0-shape {
				x := math.Pow(u, 1.0/shape)
				if x <= v {
					return x
				}
			} else {
				y := -math.Log((1 - u) / shape)
				x := math.Pow(1.0-shape+shape*y, 1.0/shape)
				if x <= v+y {
					return x
				}
			}
		}
	default:
		b := shape - 1.0/3.0
		c := 1.0 / math.Sqrt(9*b)
		for {
			var x, v float64
			for {
				x = r.gaussian()
				v = 1.0 + c*x
				if v > 0.0 {
					break
				}
			}
			v = v * v * v
			u := r.double()
			if u < 1.0-0.0331*(x*x)*(x*x) {
				return b * v
			}
			if math.Log(u) < 0.5*x*x+b*(1.0-v+math.Log(v)) {
				return b * v
			}
		}
	}
}

// gamma is np.random.gamma(shape, scale).
func (r *randomState) gamma(shape, scale float64) float64 {
	return scale * r.standardGamma(shape)
}
