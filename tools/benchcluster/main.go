// Command benchcluster is `make bench-cluster`: the scheduling benchmark
// of issue 27. It starts a simulated cluster (pdq sim engines of a
// calibrated profile, time-scaled: by default 4 prefill and 4 decode
// engines of the seed profile at half its costs, in two pdq sim
// processes), and runs the same workloads, at the same rates and with the
// same seed, through each router:
//
//   - pdq (pdq up in front of the engines, a worker each);
//   - pdq with PDQ_AFFINITY=false (affinity off);
//   - the plain P/D proxy (tools/pdproxy) with -policy round-robin, as
//     vLLM's toy proxy routes;
//   - the plain proxy with -policy least-loaded, which reads the engines'
//     vllm:num_requests_waiting, as a load-aware router would.
//
// Each run starts fresh engines (empty caches) and a fresh router. The
// load is pdq bench's (vLLM's bench serve): multi-turn chat,
// prefix_repetition, random prompts, a 10:1 tenant mix and a priority
// mix, each swept over request rates chosen from the profile's capacity
// past saturation. It prints a table per workload (goodput under an SLO
// derived from the profile, TTFT, TPOT, the prefill engines' prefix-cache
// hit share, per-tenant and per-priority TTFT, failures), checks pdq
// against the targets, and writes a PNG plot per workload.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pdq-dev/pdq/tools/internal/proc"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "benchcluster:", err)
		os.Exit(1)
	}
}

type options struct {
	workloads []string
	routers   []router
	multiples []float64 // nil: each workload's own
	quick     bool
	duration  float64 // seconds of arrivals a run
	timeScale float64
	engines   int
	profile   string
	seed      int64
	sloFactor float64
	out       string
	from      string
	pdq       string // a pdq binary to use instead of building one
	pdqEnv    []string
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("benchcluster", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	var workloads, routers, rates string
	fs.StringVar(&workloads, "workloads", "multi_turn,prefix_repetition,random,tenants,priority", "workloads to run, comma-separated")
	fs.StringVar(&routers, "routers", "pdq,pdq-noaff,rr,ll", "routers: pdq, pdq-noaff (PDQ_AFFINITY=false), rr (round-robin proxy), ll (least-loaded proxy)")
	fs.StringVar(&rates, "rates", "", "request rates as multiples of each workload's no-cache capacity, comma-separated (default: each workload's own)")
	fs.BoolVar(&o.quick, "quick", false, "one rate a workload (the middle one of its sweep) and 3 s of arrivals a run")
	fs.Float64Var(&o.duration, "duration", 6, "seconds of arrivals a run (the run lasts until every answer is in)")
	fs.Float64Var(&o.timeScale, "time-scale", 0.5, "pdq sim --time-scale: multiplies the profile's costs")
	fs.IntVar(&o.engines, "engines", 4, "prefill engines, and decode engines, of the cluster")
	fs.StringVar(&o.profile, "profile", "seed", "pdq sim --profile")
	fs.Int64Var(&o.seed, "seed", 0, "pdq bench --seed")
	fs.Float64Var(&o.sloFactor, "slo-factor", 3, "the SLO is this many times the idle TTFT (no cache hit) and TPOT of the workload's mean request")
	fs.StringVar(&o.out, "out", "bin/bench-cluster", "directory for the plots, the results (results.jsonl) and pdq bench's output (bench.log)")
	fs.StringVar(&o.from, "from", "", "print the tables, the targets and the plots of a saved results.jsonl, without running")
	fs.StringVar(&o.pdq, "pdq", "", "a pdq binary to run (default: build ./cmd/pdq)")
	var pdqEnv string
	fs.StringVar(&pdqEnv, "pdq-env", "", "settings added to pdq's, comma-separated (PDQ_FAIR_LIMIT=slots,...), for an experiment")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if pdqEnv != "" {
		o.pdqEnv = strings.Split(pdqEnv, ",")
	}
	known := allWorkloads(1)
	for _, w := range strings.Split(workloads, ",") {
		w = strings.TrimSpace(w)
		if !slices.ContainsFunc(known, func(k workload) bool { return k.key == w }) {
			return o, fmt.Errorf("-workloads: unknown workload %q", w)
		}
		o.workloads = append(o.workloads, w)
	}
	for _, k := range strings.Split(routers, ",") {
		i := slices.IndexFunc(allRouters, func(r router) bool { return r.key == strings.TrimSpace(k) })
		if i < 0 {
			return o, fmt.Errorf("-routers: unknown router %q", k)
		}
		r := allRouters[i]
		if r.pdqEnv != nil {
			r.pdqEnv = append(slices.Clip(r.pdqEnv), o.pdqEnv...)
		}
		o.routers = append(o.routers, r)
	}
	if rates != "" {
		for _, s := range strings.Split(rates, ",") {
			f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
			if err != nil || !(f > 0) {
				return o, fmt.Errorf("-rates: %q is not a positive multiple", s)
			}
			o.multiples = append(o.multiples, f)
		}
		slices.Sort(o.multiples)
	}
	if o.quick {
		o.duration = min(o.duration, 3)
	}
	if !(o.duration > 0) || !(o.timeScale > 0) || o.engines < 1 || !(o.sloFactor > 0) {
		return o, fmt.Errorf("-duration, -time-scale, -engines and -slo-factor must be positive")
	}
	return o, nil
}

// plans works out each workload's capacity, SLO and rates.
func plans(o options, model engineModel) ([]plan, error) {
	var out []plan
	for _, w := range allWorkloads(o.timeScale) {
		if !slices.Contains(o.workloads, w.key) {
			continue
		}
		p, err := planOf(w, model, o.engines, o.seed, o.sloFactor, o.multiples)
		if err != nil {
			return nil, err
		}
		if o.quick {
			p.rates = []float64{p.rates[len(p.rates)/2]}
		}
		out = append(out, p)
	}
	return out, nil
}

// specs are the runs of a plan, in order: each rate's routers, in reverse
// at every other rate (so that no router always runs first), then the
// runs beside the sweep (the small tenant alone at the highest rate, the
// idle runs).
func specs(o options, p plan) []runSpec {
	var out []runSpec
	w := p.w
	for k, rate := range p.rates {
		routers := slices.Clone(o.routers)
		if k%2 == 1 {
			slices.Reverse(routers)
		}
		for _, r := range routers {
			least := 20
			if w.conversations {
				least = 4
			}
			out = append(out, runSpec{plan: p, router: r, rate: rate, count: w.count(rate, o.duration, least)})
		}
	}
	top := p.rates[len(p.rates)-1]
	for _, r := range o.routers {
		switch w.key {
		case "tenants":
			out = append(out, runSpec{plan: p, router: r, rate: top, variant: variantAlone, count: w.count(top, o.duration, 22)})
		case "priority":
			n := 16
			if o.quick {
				n = 6
			}
			out = append(out, runSpec{plan: p, router: r, variant: variantIdle, count: n})
		}
	}
	return out
}

func run(args []string, stdout, stderr io.Writer) error {
	start := time.Now()
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	model, err := modelOf(o.profile, o.timeScale)
	if err != nil {
		return err
	}
	ps, err := plans(o, model)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	var rs []result
	if o.from != "" {
		if rs, err = loadResults(o.from); err != nil {
			return err
		}
	} else {
		if rs, err = sweep(o, model, ps, stdout, stderr); err != nil {
			return err
		}
	}
	for _, p := range ps {
		printWorkload(stdout, p, rs, o.routers)
	}
	byKey := map[string]plan{}
	for _, p := range ps {
		byKey[p.w.key] = p
	}
	printTargets(stdout, targets(rs, byKey))
	printMachine(stdout, rs)
	fmt.Fprintln(stdout)
	for _, p := range ps {
		path, err := plotWorkload(o.out, p, rs, o.routers)
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, "plot:", path)
	}
	if o.from == "" {
		fmt.Fprintf(stdout, "results: %s, pdq bench's output: %s\n", filepath.Join(o.out, "results.jsonl"), filepath.Join(o.out, "bench.log"))
	}
	fmt.Fprintf(stdout, "wall time: %s\n", elapsed(start))
	return nil
}

// sweep builds pdq and the proxy, prints what it runs, and runs every
// workload's runs.
func sweep(o options, model engineModel, ps []plan, stdout, stderr io.Writer) ([]result, error) {
	start := time.Now()
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	work, err := os.MkdirTemp("", "pdq-bench-cluster-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	c := &cluster{pdq: o.pdq, proxy: filepath.Join(work, "pdproxy"), work: work, engines: o.engines, profile: o.profile,
		timeScale: o.timeScale, model: model}
	if c.pdq == "" {
		c.pdq = filepath.Join(work, "pdq")
		if err := proc.Build(".", "./cmd/pdq", c.pdq); err != nil {
			return nil, err
		}
	}
	if err := proc.Build(".", "./tools/pdproxy", c.proxy); err != nil {
		return nil, err
	}
	var all []runSpec
	for _, p := range ps {
		all = append(all, specs(o, p)...)
	}
	fmt.Fprintf(stdout, "# make bench-cluster\n\npdq at %s; %d prefill and %d decode engines of the %s profile at time scale %g "+
		"(two pdq sim processes, restarted before each run); %s.\n", revision(), o.engines, o.engines, o.profile, o.timeScale, machine())
	fmt.Fprintf(stdout, "Engine model: a prefill engine computes %.0f prompt tokens a second (steps of %d tokens, %v each at least); "+
		"a decode step costs %v + %v a token of context; a KV read %v + %v a block of %d tokens.\n",
		1/model.perPrefillToken.Seconds(), model.budget, model.base, model.base, model.perContextToken, model.transferBase,
		model.transferPerBlock, model.blockSize)
	fmt.Fprintf(stdout, "Load: pdq bench, openai-chat, streamed, seed %d, Poisson arrivals for about %g s a run, %d output tokens. "+
		"SLO: %g× the idle TTFT (no cache hit) and TPOT of the workload's mean request. %d runs.\n",
		o.seed, o.duration, outputLen, o.sloFactor, len(all))
	log, err := os.Create(filepath.Join(o.out, "bench.log"))
	if err != nil {
		return nil, err
	}
	defer log.Close()
	var rs []result
	for i, s := range all {
		t := time.Now()
		r, err := runOne(ctx, c, o, s, log)
		if err != nil {
			return rs, fmt.Errorf("%s at %g %s through %s: %w", s.plan.w.key, s.rate, s.plan.w.unit(), s.router.name, err)
		}
		rs = append(rs, r)
		what := fmt.Sprintf("%g %s", s.rate, s.plan.w.unit())
		if s.variant != "" {
			what = s.variant
		}
		fmt.Fprintf(stderr, "[%d/%d, %s, at %s] %s %s, %s: goodput %.1f req/s (%s of %d), TTFT p99 %s ms, failed %d, prefix hits %s, prefill engines busy %s; others' CPU %s\n",
			i+1, len(all), elapsed(t), elapsed(start), s.plan.w.key, what, s.router.name, r.Goodput, pct(num(r.goodShare())), r.Requests,
			ms(r.TTFT99), r.Failed, pct(r.HitShare), pct(r.PrefillBusy), cpus(r.OtherCPU))
		if err := saveResults(filepath.Join(o.out, "results.jsonl"), rs); err != nil {
			return rs, err
		}
	}
	return rs, nil
}

func revision() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "an unknown commit"
	}
	rev := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
		rev += " with uncommitted changes"
	}
	return rev
}

func machine() string {
	cpus := 0
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		cpus = strings.Count(string(b), "processor\t:")
	}
	if cpus == 0 {
		cpus = runtime.NumCPU()
	}
	return fmt.Sprintf("%d CPUs, %s", cpus, runtime.Version())
}
