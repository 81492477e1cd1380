package pyfmt

import (
	"math"
	"testing"
)

// The expected values below are numpy 1.24's, written as Python's repr
// prints them.

func TestPercentile(t *testing.T) {
	tests := []struct {
		name   string
		values []float64
		q      float64
		want   float64
	}{
		{"p99 of 1..4", []float64{1, 2, 3, 4}, 99, 3.9699999999999998},
		{"p99.9 of 1..4", []float64{1, 2, 3, 4}, 99.9, 3.9970000000000003},
		{"p50 of 1..4", []float64{1, 2, 3, 4}, 50, 2.5},
		{"p25 of 1..4", []float64{1, 2, 3, 4}, 25, 1.75},
		{"p0 is the least", []float64{1, 2, 3, 4}, 0, 1},
		{"p100 is the most", []float64{1, 2, 3, 4}, 100, 4},
		{"unsorted input", []float64{4, 1, 3, 2}, 99, 3.9699999999999998},
		{"p90 of 1..10", []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 90, 9.1},
		{"one value", []float64{10}, 99, 10},
		{"empty is numpy's percentile of 0", nil, 99, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Percentile(tt.values, tt.q); got != tt.want {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tt.values, tt.q, got, tt.want)
			}
		})
	}
}

func TestMeanMedianStd(t *testing.T) {
	harmonic := make([]float64, 1000)
	for i := range harmonic {
		harmonic[i] = 1 / float64(i+1)
	}
	mixed := make([]float64, 257)
	for i := range mixed {
		mixed[i] = float64((i*7919)%1000) / 997.0
	}
	tests := []struct {
		name                   string
		values                 []float64
		mean, median, std, p99 float64
	}{
		{"1..4", []float64{1, 2, 3, 4}, 2.5, 2.5, 1.118033988749895, 3.9699999999999998},
		{"empty", nil, 0, 0, 0, 0},
		// Pairwise summation: a plain left-to-right sum gives a mean of
		// 0.007485470860550343.
		{"harmonic 1000", harmonic, 0.007485470860550345, 0.001998003992015968, 0.039848491723996425, 0.09099999999999991},
		{"mixed 257", mixed, 0.5012079038672437, 0.5025075225677031, 0.2887550889585623, 0.988284854563691},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Mean(tt.values); got != tt.mean {
				t.Errorf("Mean = %v, want %v", got, tt.mean)
			}
			if got := Median(tt.values); got != tt.median {
				t.Errorf("Median = %v, want %v", got, tt.median)
			}
			if got := Std(tt.values); got != tt.std {
				t.Errorf("Std = %v, want %v", got, tt.std)
			}
			if got := Percentile(tt.values, 99); got != tt.p99 {
				t.Errorf("Percentile 99 = %v, want %v", got, tt.p99)
			}
		})
	}
}

func TestPairwiseSumDiffersFromPlainSum(t *testing.T) {
	a := make([]float64, 1000)
	plain := 0.0
	for i := range a {
		a[i] = 1 / float64(i+1)
		plain += a[i]
	}
	if npSum(a) == plain {
		t.Fatalf("the harmonic test case does not tell pairwise from plain summation")
	}
	if math.Abs(npSum(a)-plain) > 1e-12 {
		t.Fatalf("pairwise %v and plain %v sums are far apart", npSum(a), plain)
	}
}
