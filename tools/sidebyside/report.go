package main

import (
	"fmt"
	"slices"
	"time"
)

// medianResult is one result made of the median of each column over rs,
// all runs of one target; the requests completed are the fewest of any
// run, and those failed the most, so that a run's failures show.
func medianResult(rs []result) result {
	if len(rs) == 1 {
		return rs[0]
	}
	med := func(f func(result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		slices.Sort(v)
		if len(v)%2 == 1 {
			return v[len(v)/2]
		}
		return (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	m := result{
		bench: bench{
			Completed: rs[0].bench.Completed, Failed: rs[0].bench.Failed,
			Duration:          med(func(r result) float64 { return r.bench.Duration }),
			RequestThroughput: med(func(r result) float64 { return r.bench.RequestThroughput }),
			OutputThroughput:  med(func(r result) float64 { return r.bench.OutputThroughput }),
			P50TTFT:           med(func(r result) float64 { return r.bench.P50TTFT }),
			P99TTFT:           med(func(r result) float64 { return r.bench.P99TTFT }),
			P50ITL:            med(func(r result) float64 { return r.bench.P50ITL }),
			P99ITL:            med(func(r result) float64 { return r.bench.P99ITL }),
		},
		cpu:   time.Duration(med(func(r result) float64 { return float64(r.cpu) })),
		rss:   int64(med(func(r result) float64 { return float64(r.rss) })),
		alloc: med(func(r result) float64 { return r.alloc }),
	}
	for _, r := range rs[1:] {
		m.bench.Completed = min(m.bench.Completed, r.bench.Completed)
		m.bench.Failed = max(m.bench.Failed, r.bench.Failed)
	}
	return m
}

func printTable(concurrency, n, runs int, targets []target, rs []result, tb table) {
	if runs > 1 {
		fmt.Printf("\nconcurrency %d, %d requests, median of %d runs\n\n", concurrency, n, runs)
	} else {
		fmt.Printf("\nconcurrency %d, %d requests\n\n", concurrency, n)
	}
	fmt.Println("| target | ok | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | req/s | tok/s | CPU s / 1k req | peak RSS MB | alloc KB / req |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|")
	for i, t := range targets {
		r := rs[i]
		cpu, rss, alloc := "-", "-", "-"
		if t.router() && r.bench.Completed > 0 {
			cpu = fmt.Sprintf("%.2f", r.cpu.Seconds()*1000/float64(r.bench.Completed))
			rss = fmt.Sprintf("%.0f", float64(r.rss)/(1<<20))
			if r.alloc > 0 {
				alloc = fmt.Sprintf("%.0f", r.alloc/1024/float64(r.bench.Completed))
			}
		}
		fmt.Printf("| %s | %d/%d | %.2f | %.2f | %.2f | %.2f | %.1f | %.0f | %s | %s | %s |\n", t.name, r.bench.Completed,
			r.bench.Completed+r.bench.Failed, r.bench.P50TTFT, r.bench.P99TTFT, r.bench.P50ITL, r.bench.P99ITL,
			r.bench.RequestThroughput, r.bench.OutputThroughput, cpu, rss, alloc)
	}
	if tb.floor == nil {
		return // no floor to compare with
	}
	floor := tb.floor.bench
	if floor.RequestThroughput == 0 {
		fmt.Println("\nthe floor served nothing: no differences to show")
		return
	}
	fmt.Println()
	for _, r := range []struct {
		name string
		r    *result
	}{{"the plain proxy", tb.proxy}, {"HEAD", tb.head}} {
		fmt.Printf("%s over the floor: TTFT p50 %+.2f ms, p99 %+.2f ms; ITL p99 %+.2f ms; req/s %.0f%% of the floor's", r.name,
			r.r.bench.P50TTFT-floor.P50TTFT, r.r.bench.P99TTFT-floor.P99TTFT, r.r.bench.P99ITL-floor.P99ITL,
			100*r.r.bench.RequestThroughput/floor.RequestThroughput)
		if tb.base.bench.Completed > 0 && r.r.bench.Completed > 0 && tb.base.cpu > 0 {
			fmt.Printf("; CPU per request %.0f%% of the baseline's", 100*perRequest(*r.r)/perRequest(*tb.base))
		}
		fmt.Println()
	}
}
