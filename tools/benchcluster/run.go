package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	pdqbench "github.com/pdq-dev/pdq/pkg/bench"
)

// The runs besides the sweep's.
const (
	// variantAlone is the small tenant alone, at its rate in the mix.
	variantAlone = "alone"
	// variantIdle is one request at a time, for the idle TTFT.
	variantIdle = "idle"
)

// result is what one run measured: one workload at one rate through one
// router. Times are in milliseconds, rates in the workload's unit.
type result struct {
	Workload string  `json:"workload"`
	Variant  string  `json:"variant,omitempty"`
	Router   string  `json:"router"`
	Rate     float64 `json:"rate"`
	// Requests is the requests of the run (turns, for multi_turn).
	Requests  int     `json:"requests"`
	Completed int     `json:"completed"`
	Failed    int     `json:"failed"`
	Duration  float64 `json:"duration_s"`
	Goodput   float64 `json:"goodput"`
	// Good is the requests that met the SLO.
	Good       int     `json:"good"`
	Throughput float64 `json:"throughput"`
	TTFT50     num     `json:"ttft_p50"`
	TTFT99     num     `json:"ttft_p99"`
	TPOT99     num     `json:"tpot_p99"`
	// HitShare is the prefill engines' prefix-cache hits over their
	// queries during the run; DecodeHitShare the decode engines'.
	// IdealShare is what a perfectly affine router would find cached of
	// the requests that succeeded. NaN when not known.
	HitShare       num `json:"hit_share"`
	DecodeHitShare num `json:"decode_hit_share"`
	IdealShare     num `json:"ideal_share"`
	// PrefillBusy is the share of the load's time the prefill engines
	// spent in steps: what a router leaves idle shows here.
	PrefillBusy num `json:"prefill_busy"`
	// Failures counts the failed requests by kind.
	Failures map[string]int `json:"failures,omitempty"`
	// Groups are the figures of each tenant or priority.
	Groups []group `json:"groups,omitempty"`
	Note   string  `json:"note,omitempty"`
	// OtherCPU is how many CPUs the rest of the machine (all but the
	// benchmark's processes) kept busy during the load, on average.
	OtherCPU num `json:"other_cpu"`
}

// group is one tenant's or priority's figures.
type group struct {
	Key       string  `json:"key"`
	Name      string  `json:"name"`
	Completed int     `json:"completed"`
	Failed    int     `json:"failed"`
	Goodput   float64 `json:"goodput"`
	TTFT50    num     `json:"ttft_p50"`
	TTFT99    num     `json:"ttft_p99"`
}

// goodShare is the share of the run's requests that met the SLO.
func (r result) goodShare() float64 {
	if r.Requests == 0 {
		return 0
	}
	return float64(r.Good) / float64(r.Requests)
}

// group returns the figures of the tenant or priority name, if any.
func (r result) group(key, name string) (group, bool) {
	for _, g := range r.Groups {
		if g.Key == key && g.Name == name {
			return g, true
		}
	}
	return group{}, false
}

// runSpec is one run to make.
type runSpec struct {
	plan    plan
	router  router
	rate    float64
	variant string
	count   int // requests (conversations) of the run
}

// runOne starts fresh engines and the router, runs the load through it
// with pdq bench, and reads the engines' prefix-cache counters around it.
func runOne(ctx context.Context, c *cluster, o options, s runSpec, log io.Writer) (result, error) {
	w := s.plan.w
	e, err := c.startEngines(ctx, w.priorityEngines)
	if err != nil {
		return result{}, err
	}
	defer e.stop()
	url, rp, stop, note, err := c.startRouter(ctx, s.router, e)
	if err != nil {
		return result{}, err
	}
	defer stop()

	cfg := pdqbench.DefaultConfig()
	w.set(&cfg)
	cfg.BaseURL, cfg.Backend, cfg.Model = url, "openai-chat", "pdq-sim"
	cfg.NumPrompts, cfg.RequestRate, cfg.Seed = s.count, s.rate, o.seed
	cfg.Goodput = s.plan.slo.goodput()
	cfg.PercentileMetrics, cfg.MetricPercentiles = "ttft,tpot,itl,e2el", "50,99"
	cfg.ReadyCheckTimeoutSec, cfg.DisableTQDM = 0, true
	cfg.RequestIDPrefix = fmt.Sprintf("bc-%s-%s-%g-%s-", w.key, s.router.key, s.rate, s.variant)
	switch s.variant {
	case variantAlone:
		cfg.Tenants = smallTenant
		cfg.RequestRate, cfg.NumPrompts = s.rate/11, max(s.count/11, 1)
	case variantIdle:
		cfg.Priorities = "0"
		cfg.RequestRate, cfg.MaxConcurrency = math.Inf(1), 1
	}

	q0, h0, b0, err := prefixCounters(ctx, e.prefill)
	if err != nil {
		return result{}, err
	}
	dq0, dh0, _, err := prefixCounters(ctx, e.decode)
	if err != nil {
		return result{}, err
	}
	pids := append(e.pids(), rp.Pid())
	cpu0, t0 := sampleCPU(pids), time.Now()
	var out bytes.Buffer
	res, err := pdqbench.Run(ctx, cfg, &out, nil)
	cpu1, t1 := sampleCPU(pids), time.Now()
	if log != nil {
		fmt.Fprintf(log, "\n### %s, %s, rate %g %s, %s\n%s", w.key, s.router.name, s.rate, w.unit(), s.variant, out.Bytes())
	}
	if err != nil {
		return result{}, fmt.Errorf("pdq bench: %w\n%s", err, out.Bytes())
	}
	q1, h1, b1, err := prefixCounters(ctx, e.prefill)
	if err != nil {
		return result{}, err
	}
	dq1, dh1, _, err := prefixCounters(ctx, e.decode)
	if err != nil {
		return result{}, err
	}

	m := res.Report.Metrics
	r := result{
		Workload: w.key, Variant: s.variant, Router: s.router.key, Rate: s.rate,
		Requests: len(res.Outputs), Completed: m.Completed, Failed: m.Failed, Duration: res.Report.Duration,
		Goodput: m.RequestGoodput, Good: int(math.Round(m.RequestGoodput * res.Report.Duration)), Throughput: m.RequestThroughput,
		TTFT50: percentile(m.TTFT, 50), TTFT99: percentile(m.TTFT, 99), TPOT99: percentile(m.TPOT, 99),
		HitShare: share(h1-h0, q1-q0), DecodeHitShare: share(dh1-dh0, dq1-dq0), IdealShare: num(math.NaN()),
		Failures: failures(res.Outputs), Note: note, OtherCPU: otherCPU(cpu0, cpu1, t1.Sub(t0).Seconds()),
		PrefillBusy: share(b1-b0, t1.Sub(t0).Seconds()*float64(len(e.prefill))),
	}
	for _, g := range res.Groups {
		r.Groups = append(r.Groups, group{Key: g.Key, Name: g.Name, Completed: g.Metrics.Completed, Failed: g.Metrics.Failed,
			Goodput: g.Metrics.RequestGoodput, TTFT50: percentile(g.Metrics.TTFT, 50), TTFT99: percentile(g.Metrics.TTFT, 99)})
	}
	if ideal, err := idealShare(c.model, w, cfg, res.Outputs); err == nil {
		r.IdealShare = num(ideal)
	}
	return r, nil
}

// idealShare is cacheShare of the run's requests that succeeded, their
// conversations' histories with the answers they got.
func idealShare(model engineModel, w workload, cfg pdqbench.Config, outputs []pdqbench.Output) (float64, error) {
	reqs, err := w.sample(cfg, cfg.NumPrompts)
	if err != nil {
		return 0, err
	}
	if len(reqs) != len(outputs) {
		return 0, fmt.Errorf("%d requests, %d outputs", len(reqs), len(outputs))
	}
	if w.conversations {
		reqs = withHistory(reqs, func(i int) string { return outputs[i].GeneratedText })
	}
	var ok []pdqbench.SampleRequest
	for i, r := range reqs {
		if outputs[i].Success {
			ok = append(ok, r)
		}
	}
	s, _, err := cacheShare(model, ok)
	return s, err
}

func nan() float64 { return math.NaN() }

// num is a figure that may not be known (NaN), which JSON has as null.
type num float64

func (n num) known() bool { return !math.IsNaN(float64(n)) }

func (n num) MarshalJSON() ([]byte, error) {
	if !n.known() || math.IsInf(float64(n), 0) {
		return []byte("null"), nil
	}
	return strconv.AppendFloat(nil, float64(n), 'g', -1, 64), nil
}

func (n *num) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*n = num(math.NaN())
		return nil
	}
	f, err := strconv.ParseFloat(string(b), 64)
	*n = num(f)
	return err
}

// percentile is the p-th percentile of a metric's statistics, NaN if it
// was not computed (no request succeeded).
func percentile(s pdqbench.Stat, p float64) num {
	for _, v := range s.Percentiles {
		if v[0] == p {
			return num(v[1])
		}
	}
	return num(math.NaN())
}

func share(part, whole float64) num {
	if whole <= 0 {
		return num(math.NaN())
	}
	return num(part / whole)
}

// retryIn is how pdq's refusals ask for a retry ("retry in 5 s", "retry
// shortly"), always with a Retry-After header.
var retryIn = regexp.MustCompile(`\bretry\b`)

// Kinds of failure.
const (
	failure429Retry = "429 asking for a retry"
	failure429      = "429 without a retry"
	failureNotSent  = "not sent (an earlier turn failed)"
)

// failureKind sorts a failed request's error, as pdq bench reports it
// (the status's reason phrase, then the body), into a kind. pdq bench
// keeps no response headers: a 429 whose body asks for a retry is one
// that pdq's gateway sends with Retry-After.
func failureKind(err string) string {
	switch {
	case strings.HasPrefix(err, "Too Many Requests"):
		if retryIn.MatchString(err) {
			return failure429Retry
		}
		return failure429
	case strings.HasPrefix(err, "not sent: an earlier turn"):
		return failureNotSent
	}
	kind, _, _ := strings.Cut(err, ":")
	if len(kind) > 60 {
		kind = kind[:60]
	}
	return kind
}

func failures(outputs []pdqbench.Output) map[string]int {
	var m map[string]int
	for _, o := range outputs {
		if !o.Success {
			if m == nil {
				m = map[string]int{}
			}
			m[failureKind(o.Error)]++
		}
	}
	return m
}

// failureNote says how many failed and of which kinds: "0", or "12: 10
// 429 asking for a retry, 2 Bad Gateway".
func failureNote(f map[string]int) string {
	n := 0
	var kinds []string
	for k, v := range f {
		n += v
		kinds = append(kinds, strconv.Itoa(v)+" "+k)
	}
	if n == 0 {
		return "0"
	}
	slices.Sort(kinds)
	return strconv.Itoa(n) + ": " + strings.Join(kinds, ", ")
}

// onlyRefusals reports whether every failure is a 429 that asks for a
// retry (or a turn not sent because of one).
func onlyRefusals(f map[string]int) bool {
	for k, v := range f {
		if v > 0 && k != failure429Retry && k != failureNotSent {
			return false
		}
	}
	return true
}

// saveResults writes the results as JSON lines.
func saveResults(path string, rs []result) error {
	var b bytes.Buffer
	for _, r := range rs {
		line, err := json.Marshal(r)
		if err != nil {
			return err
		}
		b.Write(line)
		b.WriteByte('\n')
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}

// loadResults reads what saveResults wrote.
func loadResults(path string) ([]result, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rs []result
	for line := range strings.Lines(string(b)) {
		if strings.TrimSpace(line) == "" {
			continue
		}
		r := result{PrefillBusy: num(math.NaN())} // not in older runs' files
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		rs = append(rs, r)
	}
	return rs, nil
}

func elapsed(start time.Time) string {
	return time.Since(start).Round(time.Second).String()
}
