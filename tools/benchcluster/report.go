package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// find returns the run of workload w, variant v, router r at rate, if
// any.
func find(rs []result, w, v, r string, rate float64) (result, bool) {
	for _, x := range rs {
		if x.Workload == w && x.Variant == v && x.Router == r && x.Rate == rate {
			return x, true
		}
	}
	return result{}, false
}

// sweepRates are the rates of workload w's sweep that ran, in increasing
// order.
func sweepRates(rs []result, w string) []float64 {
	var out []float64
	for _, x := range rs {
		if x.Workload == w && x.Variant == "" && !slices.Contains(out, x.Rate) {
			out = append(out, x.Rate)
		}
	}
	slices.Sort(out)
	return out
}

func ms(v num) string {
	switch f := float64(v); {
	case !v.known():
		return "–"
	case f >= 100:
		return fmt.Sprintf("%.0f", f)
	default:
		return fmt.Sprintf("%.1f", f)
	}
}

func pct(v num) string {
	if !v.known() {
		return "–"
	}
	return fmt.Sprintf("%.0f %%", 100*float64(v))
}

func routerName(key string) string {
	for _, r := range allRouters {
		if r.key == key {
			return r.name
		}
	}
	return key
}

// printWorkload prints a workload's table: a row per rate and router.
func printWorkload(w io.Writer, p plan, rs []result, routers []router) {
	wl := p.w
	fmt.Fprintf(w, "\n## %s\n\n", wl.title)
	fmt.Fprintf(w, "No-cache capacity %.3g %s (mean prompt %.0f tokens); SLO %s; rates %s %s.\n",
		p.capacity, wl.unit(), p.meanPrompt, p.slo, joinFloats(p.rates), wl.unit())
	extra := ""
	switch wl.key {
	case "tenants":
		extra = " TTFT p99 a / b |"
	case "priority":
		extra = " TTFT p99 prio 0 / 1 |"
	}
	fmt.Fprintf(w, "\n| rate (%s) | router | requests | failed | goodput (req/s) | good | TTFT p50 | TTFT p99 | TPOT p99 | prefix hits (ideal) |%s prefill busy | others' CPU |\n",
		wl.unit(), extra)
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|---|---|%s---|---|\n", strings.Repeat("---|", strings.Count(extra, "|")))
	for _, rate := range sweepRates(rs, wl.key) {
		for _, r := range routers {
			x, ok := find(rs, wl.key, "", r.key, rate)
			if !ok {
				continue
			}
			fmt.Fprintf(w, "| %g | %s | %d | %s | %.1f | %s | %s | %s | %s | %s (%s) |",
				rate, r.name, x.Requests, failureNote(x.Failures), x.Goodput, pct(num(x.goodShare())),
				ms(x.TTFT50), ms(x.TTFT99), ms(x.TPOT99), pct(x.HitShare), pct(x.IdealShare))
			switch wl.key {
			case "tenants":
				a, _ := x.group("tenant", bigTenant)
				b, _ := x.group("tenant", smallTenant)
				fmt.Fprintf(w, " %s / %s |", ms(a.TTFT99), ms(b.TTFT99))
			case "priority":
				p0, _ := x.group("priority", "0")
				p1, _ := x.group("priority", "1")
				fmt.Fprintf(w, " %s / %s |", ms(p0.TTFT99), ms(p1.TTFT99))
			}
			fmt.Fprintf(w, " %s | %s |\n", pct(x.PrefillBusy), cpus(x.OtherCPU))
		}
	}
	var extras []string
	for _, x := range rs {
		if x.Workload != wl.key || x.Variant == "" {
			continue
		}
		switch x.Variant {
		case variantAlone:
			b, _ := x.group("tenant", smallTenant)
			extras = append(extras, fmt.Sprintf("- tenant %s alone at %.3g req/s (its rate in the mix at %g), %s: %d requests, %s failed, TTFT p50 %s ms, p99 %s ms",
				smallTenant, x.Rate/11, x.Rate, routerName(x.Router), x.Requests, failureNote(x.Failures), ms(b.TTFT50), ms(b.TTFT99)))
		case variantIdle:
			extras = append(extras, fmt.Sprintf("- idle (one request at a time), %s: %d requests, %s failed, TTFT p50 %s ms, p99 %s ms, TPOT p99 %s ms",
				routerName(x.Router), x.Requests, failureNote(x.Failures), ms(x.TTFT50), ms(x.TTFT99), ms(x.TPOT99)))
		}
	}
	if len(extras) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintln(w, strings.Join(extras, "\n"))
	}
	var notes []string
	for _, x := range rs {
		if x.Workload == wl.key && x.Note != "" && !slices.Contains(notes, routerName(x.Router)+": "+x.Note) {
			notes = append(notes, routerName(x.Router)+": "+x.Note)
		}
	}
	for _, n := range notes {
		fmt.Fprintln(w, "\nNote:", n)
	}
}

// cpus is a number of CPUs kept busy.
func cpus(v num) string {
	if !v.known() {
		return "–"
	}
	return fmt.Sprintf("%.2f", float64(v))
}

// busyThreshold is the CPU the rest of the machine may use during a run
// before the run counts as disturbed.
const busyThreshold = 0.2

// printMachine says how many runs shared the machine with other work:
// each of them when they are few, else how much CPU the rest of the
// machine took.
func printMachine(w io.Writer, rs []result) {
	var busy []string
	var all []float64
	for _, x := range rs {
		if !x.OtherCPU.known() {
			continue
		}
		all = append(all, float64(x.OtherCPU))
		if float64(x.OtherCPU) > busyThreshold {
			what := fmt.Sprintf("%s at %g", x.Workload, x.Rate)
			if x.Variant != "" {
				what = x.Workload + " " + x.Variant
			}
			busy = append(busy, fmt.Sprintf("%s through %s (%s)", what, routerName(x.Router), cpus(x.OtherCPU)))
		}
	}
	if len(all) == 0 {
		return
	}
	slices.Sort(all)
	fmt.Fprintf(w, "\nThe rest of the machine (processes other than the benchmark's, and the hypervisor's steal) kept more than %.1f CPU busy during %d of %d runs",
		busyThreshold, len(busy), len(all))
	switch {
	case len(busy) == 0:
		fmt.Fprintln(w, ".")
	case len(busy) <= 8:
		fmt.Fprintf(w, ": %s. Their figures are less trustworthy.\n", strings.Join(busy, ", "))
	default:
		fmt.Fprintf(w, " (a median of %.2f CPU over all runs, at most %.2f): the figures of this run are less trustworthy than a quiet machine's.\n",
			all[len(all)/2], all[len(all)-1])
	}
}

func joinFloats(fs []float64) string {
	var s []string
	for _, f := range fs {
		s = append(s, fmt.Sprintf("%g", f))
	}
	return strings.Join(s, ", ")
}

// verdict is one row of the targets table.
type verdict struct {
	workload, target string
	// figures are pdq's (and what it is held against); others the
	// proxies' figures for the same target, where one applies.
	figures, others string
	met             bool
}

// The targets of issue 27, as ratios.
const (
	minGoodputVsRoundRobin   = 1.5
	minGoodputVsLeastLoaded  = 1.2
	minShareOfIdealHits      = 0.9
	maxSmallTenantVsAlone    = 1.5
	maxPriorityZeroVsIdle    = 1.2
	minGoodShareOfRoundRobin = 0.5
)

// ratioText prints a ratio with two decimals, or more where two would
// print it equal to its bound without being equal: 89.96, not 90.00,
// when 90 is the bound.
func ratioText(k, bound float64) string {
	for _, prec := range []int{2, 3, 4} {
		t := strconv.FormatFloat(k, 'f', prec, 64)
		if t != strconv.FormatFloat(bound, 'f', prec, 64) || atLeast(k, bound) && atLeast(bound, k) {
			return t
		}
	}
	return strconv.FormatFloat(k, 'g', -1, 64)
}

// atLeast reports whether a ≥ b, but for rounding: figures printed as
// equal to a bound meet it.
func atLeast(a, b float64) bool { return a >= b*(1-1e-9) }

// referenceRate is the highest rate of workload w's sweep at which the
// round-robin proxy met the SLO on at least half its requests.
func referenceRate(rs []result, w string) (float64, bool) {
	best, ok := 0.0, false
	for _, rate := range sweepRates(rs, w) {
		if x, found := find(rs, w, "", "rr", rate); found && atLeast(x.goodShare(), minGoodShareOfRoundRobin) {
			best, ok = rate, true
		}
	}
	return best, ok
}

// targets checks pdq's runs against issue 27's targets.
func targets(rs []result, plans map[string]plan) []verdict {
	var out []verdict
	ratio := func(a, b float64) float64 {
		if b == 0 {
			return math.Inf(1)
		}
		return a / b
	}
	unit := func(w string) string {
		if p, ok := plans[w]; ok {
			return p.w.unit()
		}
		return "req/s"
	}
	goodputRows := func(w, title string, vsRR, vsLL bool) {
		rate, ok := referenceRate(rs, w)
		if !ok {
			if len(sweepRates(rs, w)) > 0 {
				out = append(out, verdict{workload: title, target: "goodput at the highest rate where the round-robin proxy meets the SLO on half its requests",
					figures: "the round-robin proxy met the SLO on half its requests at no rate of the sweep: no reference rate"})
			}
			return
		}
		pdq, okP := find(rs, w, "", "pdq", rate)
		rr, okR := find(rs, w, "", "rr", rate)
		ll, okL := find(rs, w, "", "ll", rate)
		at := fmt.Sprintf("at %g %s", rate, unit(w))
		if vsRR && okP && okR {
			k := ratio(pdq.Goodput, rr.Goodput)
			out = append(out, verdict{workload: title, target: fmt.Sprintf("pdq's goodput ≥ %g× the round-robin proxy's", minGoodputVsRoundRobin),
				figures: fmt.Sprintf("%s: %.1f against %.1f req/s, %s×", at, pdq.Goodput, rr.Goodput, ratioText(k, minGoodputVsRoundRobin)), met: atLeast(k, minGoodputVsRoundRobin)})
		}
		if vsLL && okP && okL {
			k := ratio(pdq.Goodput, ll.Goodput)
			want := minGoodputVsLeastLoaded
			target := fmt.Sprintf("pdq's goodput ≥ %g× the least-loaded proxy's", want)
			if !vsRR {
				want, target = 1, "pdq's goodput ≥ the least-loaded proxy's"
			}
			out = append(out, verdict{workload: title, target: target,
				figures: fmt.Sprintf("%s: %.1f against %.1f req/s, %s×", at, pdq.Goodput, ll.Goodput, ratioText(k, want)), met: atLeast(k, want)})
		}
		if !okP {
			out = append(out, verdict{workload: title, target: "pdq's goodput", figures: at + ": pdq did not run"})
		}
	}
	if _, ok := plans["multi_turn"]; ok {
		goodputRows("multi_turn", "multi-turn chat", true, true)
		if rate, ok := referenceRate(rs, "multi_turn"); ok {
			if pdq, found := find(rs, "multi_turn", "", "pdq", rate); found && pdq.HitShare.known() && pdq.IdealShare.known() {
				k := float64(pdq.HitShare) / float64(pdq.IdealShare)
				var others []string
				for _, key := range []string{"rr", "ll"} {
					if x, ok := find(rs, "multi_turn", "", key, rate); ok && x.HitShare.known() && x.IdealShare.known() {
						others = append(others, fmt.Sprintf("%s %s (%.0f %% of ideal)", routerName(key), pct(x.HitShare), 100*float64(x.HitShare)/float64(x.IdealShare)))
					}
				}
				out = append(out, verdict{workload: "multi-turn chat", target: fmt.Sprintf("prefix-cache hit share ≥ %.0f %% of a perfectly affine router's", 100*minShareOfIdealHits),
					figures: fmt.Sprintf("at %g conv/s: %s of the prefill engines' lookups hit, the ideal %s: %s %%", rate, pct(pdq.HitShare), pct(pdq.IdealShare), ratioText(100*k, 100*minShareOfIdealHits)),
					others:  strings.Join(others, ", "), met: atLeast(k, minShareOfIdealHits)})
			}
		}
	}
	if _, ok := plans["prefix_repetition"]; ok {
		goodputRows("prefix_repetition", "prefix_repetition", true, true)
	}
	if _, ok := plans["random"]; ok {
		goodputRows("random", "random (no shared prefixes)", false, true)
	}
	// Overload rows: at the sweep's highest rate.
	if r := sweepRates(rs, "tenants"); len(r) > 0 {
		rate := r[len(r)-1]
		check := func(key string) (string, bool, bool) {
			mix, ok1 := find(rs, "tenants", "", key, rate)
			alone, ok2 := find(rs, "tenants", variantAlone, key, rate)
			if !ok1 || !ok2 {
				return "", false, false
			}
			b, _ := mix.group("tenant", smallTenant)
			a, _ := alone.group("tenant", smallTenant)
			if !b.TTFT99.known() || !a.TTFT99.known() {
				return fmt.Sprintf("TTFT p99 %s ms in the mix, %s ms alone", ms(b.TTFT99), ms(a.TTFT99)), false, true
			}
			k := float64(b.TTFT99) / float64(a.TTFT99)
			return fmt.Sprintf("%s ms in the mix, %s ms alone: %s×", ms(b.TTFT99), ms(a.TTFT99), ratioText(k, maxSmallTenantVsAlone)), atLeast(maxSmallTenantVsAlone, k), true
		}
		if fig, met, ok := check("pdq"); ok {
			out = append(out, verdict{workload: "tenants 10:1, overload", target: fmt.Sprintf("the small tenant's TTFT p99 ≤ %g× its TTFT p99 alone at the same rate", maxSmallTenantVsAlone),
				figures: fmt.Sprintf("at %g req/s: %s", rate, fig), others: othersOf([]string{"rr", "ll"}, check), met: met})
		}
	}
	if r := sweepRates(rs, "priority"); len(r) > 0 {
		rate := r[len(r)-1]
		check := func(key string) (string, bool, bool) {
			x, ok1 := find(rs, "priority", "", key, rate)
			idle, ok2 := find(rs, "priority", variantIdle, key, 0)
			if !ok1 || !ok2 {
				return "", false, false
			}
			p0, _ := x.group("priority", "0")
			if !p0.TTFT99.known() || !idle.TTFT99.known() {
				return fmt.Sprintf("TTFT p99 of priority 0 %s ms, idle %s ms", ms(p0.TTFT99), ms(idle.TTFT99)), false, true
			}
			k := float64(p0.TTFT99) / float64(idle.TTFT99)
			return fmt.Sprintf("%s ms, idle %s ms: %s×", ms(p0.TTFT99), ms(idle.TTFT99), ratioText(k, maxPriorityZeroVsIdle)), atLeast(maxPriorityZeroVsIdle, k), true
		}
		if fig, met, ok := check("pdq"); ok {
			out = append(out, verdict{workload: "priority 0 among priority 1, overload", target: fmt.Sprintf("TTFT p99 of priority 0 ≤ %g× the idle TTFT (p99 of one request at a time)", maxPriorityZeroVsIdle),
				figures: fmt.Sprintf("at %g req/s: %s", rate, fig), others: othersOf([]string{"rr", "ll"}, check), met: met})
		}
	}
	check := func(key string) (string, bool, bool) {
		var below, above []string
		belowFailed, aboveBad, runs := 0, 0, 0
		for _, x := range rs {
			if x.Router != key || x.Variant != "" {
				continue
			}
			p, ok := plans[x.Workload]
			if !ok {
				continue
			}
			runs++
			n := 0
			for _, v := range x.Failures {
				n += v
			}
			where := fmt.Sprintf("%s at %g", x.Workload, x.Rate)
			if x.Rate < p.capacity {
				belowFailed += n
				if n > 0 {
					below = append(below, where+": "+failureNote(x.Failures))
				}
			} else if n > 0 {
				if !onlyRefusals(x.Failures) {
					aboveBad++
				}
				above = append(above, where+": "+failureNote(x.Failures))
			}
		}
		if runs == 0 {
			return "", false, false
		}
		fig := fmt.Sprintf("below the no-cache capacity: %d failed", belowFailed)
		if len(below) > 0 {
			fig += " (" + strings.Join(below, "; ") + ")"
		}
		if len(above) == 0 {
			fig += "; above it: none failed"
		} else {
			fig += "; above it: " + strings.Join(above, "; ")
		}
		return fig, belowFailed == 0 && aboveBad == 0, true
	}
	if fig, met, ok := check("pdq"); ok {
		out = append(out, verdict{workload: "all", target: "0 failed requests below saturation; above it, only 429s with Retry-After",
			figures: fig, others: othersOf([]string{"rr", "ll"}, check), met: met})
	}
	return out
}

// othersOf is the proxies' figures and verdicts for a target.
func othersOf(keys []string, check func(string) (string, bool, bool)) string {
	var out []string
	for _, k := range keys {
		if fig, met, ok := check(k); ok {
			out = append(out, fmt.Sprintf("%s: %s (%s)", routerName(k), fig, yesNo(met)))
		}
	}
	return strings.Join(out, "; ")
}

func yesNo(met bool) string {
	if met {
		return "met"
	}
	return "not met"
}

// printTargets prints the targets table.
func printTargets(w io.Writer, vs []verdict) {
	fmt.Fprintln(w, "\n## Against the targets (issue 27)")
	fmt.Fprintln(w, "\n| workload | target | pdq | verdict | the proxies |")
	fmt.Fprintln(w, "|---|---|---|---|---|")
	for _, v := range vs {
		verdict := yesNo(v.met)
		if strings.Contains(v.figures, "no reference rate") || strings.Contains(v.figures, "did not run") {
			verdict = "not met (not measured)"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", v.workload, v.target, v.figures, verdict, v.others)
	}
}
