package pyfmt

import (
	"math"
	"slices"
)

// This file holds the numpy functions vLLM's serve.py calls on its lists of
// latencies, computed the way numpy computes them for a float64 array so
// that the printed numbers agree to the last digit: np.mean and np.std
// (population, ddof=0) sum with numpy's pairwise summation, np.median
// averages the two middle values, and np.percentile is the default
// "linear" method. Each takes the list vLLM passes as `values or 0`: an
// empty list is the scalar 0, so every statistic of it is 0.

// pwBlockSize is numpy's PW_BLOCKSIZE (numpy/_core/src/umath/loops_utils.h).
const pwBlockSize = 128

// pairwiseSum is numpy's pairwise_sum_DOUBLE: eight running sums over
// blocks of up to 128 values, halves of longer runs summed apart.
func pairwiseSum(a []float64) float64 {
	n := len(a)
	switch {
	case n < 8:
		res := 0.0
		for _, v := range a {
			res += v
		}
		return res
	case n <= pwBlockSize:
		var r [8]float64
		copy(r[:], a[:8])
		i := 8
		for ; i < n-n%8; i += 8 {
			for j := range r {
				r[j] += a[i+j]
			}
		}
		res := ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
		for ; i < n; i++ {
			res += a[i]
		}
		return res
	default:
		n2 := n / 2
		n2 -= n2 % 8
		return pairwiseSum(a[:n2]) + pairwiseSum(a[n2:])
	}
}

// npSum is np.add.reduce over a 1-D float64 array: the identity 0.0 plus
// the pairwise sum of every element.
func npSum(a []float64) float64 { return 0.0 + pairwiseSum(a) }

// Mean is np.mean(values or 0).
func Mean(values []float64) float64 {
	if len(values) == 0 {
		return 0
	}
	return npSum(values) / float64(len(values))
}

// Std is np.std(values or 0): the population standard deviation (ddof=0),
// computed as numpy's _var does: the mean, the squared deviations, their
// mean, its square root.
func Std(values []float64) float64 {
	if len(values) == 0 {
		return 0
	}
	m := Mean(values)
	sq := make([]float64, len(values))
	for i, v := range values {
		d := v - m
		sq[i] = d * d
	}
	return math.Sqrt(npSum(sq) / float64(len(values)))
}

// Median is np.median(values or 0).
func Median(values []float64) float64 {
	n := len(values)
	if n == 0 {
		return 0
	}
	s := slices.Clone(values)
	slices.Sort(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (0.0 + s[n/2-1] + s[n/2]) / 2
}

// Percentile is np.percentile(values or 0, q) with numpy's default method,
// "linear": the value at virtual index (n-1)*q/100, interpolated between
// its neighbours as numpy's _lerp does (from the upper neighbour when the
// fraction is at least one half).
func Percentile(values []float64, q float64) float64 {
	n := len(values)
	if n == 0 {
		return 0
	}
	s := slices.Clone(values)
	slices.Sort(s)
	vi := float64(n-1) * (q / 100)
	if vi >= float64(n-1) {
		return s[n-1]
	}
	if vi < 0 {
		return s[0]
	}
	prev := math.Floor(vi)
	a, b := s[int(prev)], s[int(prev)+1]
	return lerp(a, b, vi-prev)
}

// lerp is numpy's _lerp.
func lerp(a, b, t float64) float64 {
	d := b - a
	if t >= 0.5 {
		return b - d*(1-t)
	}
	return a + d*t
}
