package main

import (
	"bytes"
	"context"
	"fmt"
	"image/png"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	pdqbench "github.com/pdq-dev/pdq/pkg/bench"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/tools/internal/enginemetrics"
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

// The engine model is the seed profile's costs, scaled: the figures the
// rates and SLOs come from, worked out by hand.
func TestEngineModel(t *testing.T) {
	m, err := modelOf("seed", 0.5)
	if err != nil {
		t.Fatal(err)
	}
	// Seed: base 6 ms, 100 µs a prompt token, 195 ns a context token, a
	// read 2 ms + 840 µs a block; all halved.
	if m.base != 3*time.Millisecond || m.perPrefillToken != 50*time.Microsecond || m.perContextToken != 97 ||
		m.transferBase != time.Millisecond || m.transferPerBlock != 420*time.Microsecond || m.blockSize != 16 || m.budget != 8192 {
		t.Fatalf("model = %+v", m)
	}
	// 2,000 tokens: one step of 3 + 100 ms, a read of 125 blocks (1 + 52.5
	// ms), the decode engine's first step (3 ms + 50 µs).
	if got, want := m.idleTTFT(2000), 103*time.Millisecond+53500*time.Microsecond+3050*time.Microsecond; got != want {
		t.Errorf("idleTTFT(2000) = %v, want %v", got, want)
	}
	// 10,000 tokens: two steps.
	if got, want := m.idleTTFT(10000), 2*3*time.Millisecond+500*time.Millisecond+time.Millisecond+625*420*time.Microsecond+3050*time.Microsecond; got != want {
		t.Errorf("idleTTFT(10000) = %v, want %v", got, want)
	}
	// 3 ms + 2,000 × 97 ns (97.5, truncated as pdq sim scales it).
	if got, want := m.idleTPOT(2000), 3*time.Millisecond+194*time.Microsecond; got != want {
		t.Errorf("idleTPOT(2000) = %v, want %v", got, want)
	}
	// A full step: 8,192 tokens in 3 + 409.6 ms; 4 engines; 2,048-token prompts.
	if got, want := m.prefillCapacity(4, 2048), 4*8192/0.4126/2048; !near(got, want) {
		t.Errorf("prefillCapacity = %v, want %v", got, want)
	}
	// 3 × 159.55 ms → 479; 3 × (3 + 2,016 × 97 ns = 3.1956 ms) → 10.
	if got := m.sloOf(2000, 32, 3); got != (slo{TTFT: 479, TPOT: 10}) {
		t.Errorf("sloOf = %+v", got)
	}
	if got := strings.Join(slo{TTFT: 479, TPOT: 10}.goodput(), " "); got != "ttft:479 tpot:10" {
		t.Errorf("goodput flags %q", got)
	}
}

func TestRates(t *testing.T) {
	for _, tc := range []struct {
		capacity  float64
		multiples []float64
		want      []float64
	}{
		{38.6, []float64{0.6, 1, 1.4}, []float64{23, 39, 54}},
		{5.62, []float64{1, 2, 3}, []float64{5.6, 11, 17}},
		{0.123, []float64{1, 10}, []float64{0.12, 1.2}},
		// Rates that round alike are run once.
		{100, []float64{1, 1.001, 2}, []float64{100, 200}},
		{10, []float64{0, 1}, []float64{10}},
	} {
		if got := rates(tc.capacity, tc.multiples); !slices.Equal(got, tc.want) {
			t.Errorf("rates(%v, %v) = %v, want %v", tc.capacity, tc.multiples, got, tc.want)
		}
	}
	for _, x := range []float64{0, -1, math.Inf(1), math.NaN()} {
		if round2(x) != 0 {
			t.Errorf("round2(%v) = %v", x, round2(x))
		}
	}
}

func TestCount(t *testing.T) {
	w := workload{multipleOf: 11}
	for _, tc := range []struct {
		rate, seconds float64
		least, want   int
	}{
		{39, 6, 20, 231}, {3, 6, 20, 11}, {100, 6, 20, 594}, {0.1, 6, 30, 22},
	} {
		if got := w.count(tc.rate, tc.seconds, tc.least); got != tc.want {
			t.Errorf("count(%v, %v, %d) = %d, want %d", tc.rate, tc.seconds, tc.least, got, tc.want)
		}
	}
	if got := (workload{}).count(7.3, 6, 4); got != 44 {
		t.Errorf("count = %d, want 44", got)
	}
}

// cacheShare is what one engine that has seen every earlier prompt finds
// cached: checked against a pdq sim engine of the seed profile, sent the
// same chat requests one after the other, whose prefix-cache counters
// must say the same.
func TestCacheShareMatchesTheEngine(t *testing.T) {
	model, err := modelOf("seed", 1)
	if err != nil {
		t.Fatal(err)
	}
	cfg := simtest.FastConfig()
	cfg.Profile, cfg.TimeScale = "seed", 0.001
	e := simtest.Start(t, cfg)

	reqs, err := pdqbench.PrefixRepetitionDataset{PrefixLen: 70, SuffixLen: 20, NumPrefixes: 3, OutputLen: 2, Seed: 7}.Sample(12, "")
	if err != nil {
		t.Fatal(err)
	}
	conv, err := pdqbench.MultiTurnDataset{Turns: 3, CommonPrefixLen: 30, PrefixLen: 40, UserLen: 25, OutputLen: 2, Seed: 7}.Sample(2, "")
	if err != nil {
		t.Fatal(err)
	}
	reqs = append(reqs, withHistory(conv, func(i int) string { return fmt.Sprintf("answer number %d", i) })...)
	// A prompt of exactly whole blocks, twice: the second computes its
	// last token, so its last block is no hit.
	for n := 1; n < 60; n++ {
		r := pdqbench.SampleRequest{Prompt: strings.TrimSpace(strings.Repeat("word ", n)), OutputLen: 2}
		if ids, _ := promptIDs(model, r); len(ids) == 32 {
			reqs = append(reqs, r, r)
			break
		}
	}
	want, mean, err := cacheShare(model, reqs)
	if err != nil {
		t.Fatal(err)
	}
	var total int
	for _, r := range reqs {
		body, err := pdqbench.ChatBody("pdq-sim", r)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.Post(e.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		buf.ReadFrom(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, buf.Bytes())
		}
		ids, _ := promptIDs(model, r)
		total += len(ids)
	}
	m, err := enginemetrics.Fetch(context.Background(), http.DefaultClient, e.URL)
	if err != nil {
		t.Fatal(err)
	}
	if q := m[enginemetrics.PrefixQueries]; q != float64(total) || !near(mean, float64(total)/float64(len(reqs))) {
		t.Errorf("the engine looked up %v prompt tokens, cacheShare counted %d (mean %v)", q, total, mean)
	}
	if got := m[enginemetrics.PrefixHits] / m[enginemetrics.PrefixQueries]; !near(got, want) || want < 0.3 {
		t.Errorf("the engine's hit share is %v, cacheShare's %v", got, want)
	}
}

func TestRatioText(t *testing.T) {
	for _, tc := range []struct {
		k, bound float64
		want     string
	}{
		{1.4996, 1.5, "1.4996"}, {1.49999, 1.5, "1.49999"}, {1.5, 1.5, "1.50"}, {1.23, 1.5, "1.23"},
		{89.6, 90, "89.60"}, {89.996, 90, "89.996"}, {1.2049, 1.2, "1.205"},
	} {
		if got := ratioText(tc.k, tc.bound); got != tc.want {
			t.Errorf("ratioText(%v, %v) = %q, want %q", tc.k, tc.bound, got, tc.want)
		}
	}
}

func TestFailures(t *testing.T) {
	for err, want := range map[string]string{
		`Too Many Requests: {"error":{"message":"the queue is full; retry in 5 s"}}`:                                  failure429Retry,
		`Too Many Requests: {"error":{"message":"the gateway holds 10 bytes of requests, its limit; retry shortly"}}`: failure429Retry,
		`Too Many Requests: slow down`:                                   failure429,
		`Bad Gateway: the prefill engine returned no kv_transfer_params`: "Bad Gateway",
		`not sent: an earlier turn of its conversation failed`:           failureNotSent,
		`Post "http://127.0.0.1:1/v1/chat/completions": dial tcp`:        "Post \"http",
	} {
		if got := failureKind(err); got != want {
			t.Errorf("failureKind(%q) = %q, want %q", err, got, want)
		}
	}
	f := failures([]pdqbench.Output{{Success: true}, {Error: "Too Many Requests: retry in 1 s"}, {Error: "Too Many Requests: retry in 1 s"},
		{Error: "not sent: an earlier turn of its conversation failed"}})
	if got := failureNote(f); got != "3: 1 not sent (an earlier turn failed), 2 429 asking for a retry" {
		t.Errorf("failureNote = %q", got)
	}
	if !onlyRefusals(f) || !onlyRefusals(nil) {
		t.Error("refusals and turns not sent after them are only refusals")
	}
	f["Bad Gateway"] = 1
	if onlyRefusals(f) {
		t.Error("a 502 is not a refusal")
	}
	if failureNote(nil) != "0" {
		t.Error("no failure is 0")
	}
}

// res is a sweep run with figures for the targets.
func res(w, router string, rate, goodput float64, good, requests int) result {
	return result{Workload: w, Router: router, Rate: rate, Goodput: goodput, Good: good, Requests: requests, Completed: requests,
		TTFT50: num(math.NaN()), TTFT99: num(math.NaN()), TPOT99: num(math.NaN()), HitShare: num(math.NaN()), IdealShare: num(math.NaN()),
		OtherCPU: num(math.NaN()), PrefillBusy: num(math.NaN())}
}

func TestTargets(t *testing.T) {
	plans := map[string]plan{}
	for _, w := range allWorkloads(1) {
		plans[w.key] = plan{w: w, capacity: 12}
	}
	withHits := func(r result, hit, ideal float64) result { r.HitShare, r.IdealShare = num(hit), num(ideal); return r }
	withGroup := func(r result, key, name string, ttft99 float64) result {
		r.Groups = append(r.Groups, group{Key: key, Name: name, TTFT99: num(ttft99)})
		return r
	}
	rs := []result{
		// multi_turn: the round-robin proxy meets the SLO on half its
		// requests at 5 and 10 conv/s, not 15: the reference rate is 10.
		res("multi_turn", "rr", 5, 20, 100, 100), withHits(res("multi_turn", "rr", 10, 20, 50, 100), 0.4, 0.8), res("multi_turn", "rr", 15, 5, 49, 100),
		res("multi_turn", "ll", 10, 25, 60, 100),
		withHits(res("multi_turn", "pdq", 10, 30, 90, 100), 0.72, 0.8),
		// prefix_repetition: pdq 1.5× round-robin, 1.19× least-loaded.
		res("prefix_repetition", "rr", 20, 20, 80, 100), res("prefix_repetition", "ll", 20, 25.2, 80, 100),
		res("prefix_repetition", "pdq", 20, 30, 90, 100),
		// random: the round-robin proxy never meets it on half.
		res("random", "rr", 20, 2, 10, 100), res("random", "pdq", 20, 3, 10, 100),
		// tenants: 1.4× alone for pdq, 3× for the proxy.
		withGroup(res("tenants", "pdq", 14, 1, 1, 1), "tenant", smallTenant, 700),
		withGroup(res("tenants", "rr", 14, 1, 1, 1), "tenant", smallTenant, 1500),
		withGroup(result{Workload: "tenants", Variant: variantAlone, Router: "pdq", Rate: 14}, "tenant", smallTenant, 500),
		withGroup(result{Workload: "tenants", Variant: variantAlone, Router: "rr", Rate: 14}, "tenant", smallTenant, 500),
		withGroup(res("tenants", "pdq", 7, 1, 1, 1), "tenant", smallTenant, 100), // not the highest rate
		// priority: 1.25× idle.
		withGroup(res("priority", "pdq", 14, 1, 1, 1), "priority", "0", 250),
		{Workload: "priority", Variant: variantIdle, Router: "pdq", TTFT99: 200},
	}
	// Failures: one 502 below capacity for the least-loaded proxy, 429s
	// above it for pdq.
	rs[3].Failures = map[string]int{"Bad Gateway": 1}
	rs[len(rs)-2].Failures = map[string]int{failure429Retry: 4}

	got := targets(rs, plans)
	var lines []string
	for _, v := range got {
		lines = append(lines, fmt.Sprintf("%s | %s | %s | %v | %s", v.workload, v.target, v.figures, v.met, v.others))
	}
	want := []string{
		"multi-turn chat | pdq's goodput ≥ 1.5× the round-robin proxy's | at 10 conv/s: 30.0 against 20.0 req/s, 1.50× | true | ",
		"multi-turn chat | pdq's goodput ≥ 1.2× the least-loaded proxy's | at 10 conv/s: 30.0 against 25.0 req/s, 1.20× | true | ",
		"multi-turn chat | prefix-cache hit share ≥ 90 % of a perfectly affine router's | at 10 conv/s: 72 % of the prefill engines' lookups hit, the ideal 80 %: 90.00 % | true | round-robin proxy 40 % (50 % of ideal)",
		"prefix_repetition | pdq's goodput ≥ 1.5× the round-robin proxy's | at 20 req/s: 30.0 against 20.0 req/s, 1.50× | true | ",
		"prefix_repetition | pdq's goodput ≥ 1.2× the least-loaded proxy's | at 20 req/s: 30.0 against 25.2 req/s, 1.19× | false | ",
		"random (no shared prefixes) | goodput at the highest rate where the round-robin proxy meets the SLO on half its requests | the round-robin proxy met the SLO on half its requests at no rate of the sweep: no reference rate | false | ",
		"tenants 10:1, overload | the small tenant's TTFT p99 ≤ 1.5× its TTFT p99 alone at the same rate | at 14 req/s: 700 ms in the mix, 500 ms alone: 1.40× | true | round-robin proxy: 1500 ms in the mix, 500 ms alone: 3.00× (not met)",
		"priority 0 among priority 1, overload | TTFT p99 of priority 0 ≤ 1.2× the idle TTFT (p99 of one request at a time) | at 14 req/s: 250 ms, idle 200 ms: 1.25× | false | ",
		"all | 0 failed requests below saturation; above it, only 429s with Retry-After | below the no-cache capacity: 0 failed; above it: priority at 14: 4: 4 429 asking for a retry | true | " +
			"round-robin proxy: below the no-cache capacity: 0 failed; above it: none failed (met); " +
			"least-loaded proxy: below the no-cache capacity: 1 failed (multi_turn at 10: 1: 1 Bad Gateway); above it: none failed (not met)",
	}
	if len(lines) != len(want) {
		t.Fatalf("%d rows:\n%s\nwant %d:\n%s", len(lines), strings.Join(lines, "\n"), len(want), strings.Join(want, "\n"))
	}
	for i := range want {
		if lines[i] != want[i] {
			t.Errorf("row %d:\n got %s\nwant %s", i, lines[i], want[i])
		}
	}
}

func TestSpecs(t *testing.T) {
	o := options{routers: allRouters, duration: 6}
	ws := allWorkloads(0.5)
	tenants := ws[slices.IndexFunc(ws, func(w workload) bool { return w.key == "tenants" })]
	got := specs(o, plan{w: tenants, rates: []float64{10, 20}})
	var order []string
	for _, s := range got {
		order = append(order, fmt.Sprintf("%g %s %s %d", s.rate, s.router.key, s.variant, s.count))
	}
	want := []string{
		"10 pdq  55", "10 pdq-noaff  55", "10 rr  55", "10 ll  55",
		"20 ll  110", "20 rr  110", "20 pdq-noaff  110", "20 pdq  110",
		"20 pdq alone 110", "20 pdq-noaff alone 110", "20 rr alone 110", "20 ll alone 110",
	}
	if !slices.Equal(order, want) {
		t.Errorf("specs:\n%s\nwant\n%s", strings.Join(order, "\n"), strings.Join(want, "\n"))
	}
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"-quick", "-workloads", "random,priority", "-routers", "rr,pdq", "-rates", "2,0.5"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(o.workloads, []string{"random", "priority"}) || len(o.routers) != 2 || o.routers[0].key != "rr" ||
		!slices.Equal(o.multiples, []float64{0.5, 2}) || o.duration != 3 {
		t.Errorf("options %+v", o)
	}
	for _, args := range [][]string{
		{"-workloads", "chat"}, {"-routers", "nginx"}, {"-rates", "0"}, {"-rates", "x"}, {"-duration", "0"}, {"extra"},
	} {
		if _, err := parseFlags(args, &bytes.Buffer{}); err == nil {
			t.Errorf("parseFlags(%q) accepted it", args)
		}
	}
	// The quick sweep runs the middle rate of each workload.
	model, _ := modelOf("seed", 0.5)
	o, _ = parseFlags([]string{"-quick", "-workloads", "random"}, &bytes.Buffer{})
	ps, err := plans(o, model)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 1 || len(ps[0].rates) != 1 || ps[0].rates[0] != round2(ps[0].capacity) {
		t.Errorf("quick plans: %+v", ps)
	}
}

func TestUnknownSettings(t *testing.T) {
	lines := []string{`{"level":"WARN","msg":"unknown PDQ_ variable: ignored (see the README for the known ones)","name":"PDQ_AFFINITY"}`}
	if got := unknownSettings(lines, []string{"PDQ_AFFINITY=false"}); !strings.HasPrefix(got, "PDQ_AFFINITY unknown") {
		t.Errorf("unknownSettings = %q", got)
	}
	if got := unknownSettings(nil, []string{"PDQ_AFFINITY=false"}); got != "" {
		t.Errorf("a known setting: %q", got)
	}
}

func TestPlotAndResults(t *testing.T) {
	dir := t.TempDir()
	ws := allWorkloads(0.5)
	p := plan{w: ws[0], slo: slo{TTFT: 500, TPOT: 10}, rates: []float64{5, 10}}
	rs := []result{res("multi_turn", "pdq", 5, 20, 100, 100), res("multi_turn", "pdq", 10, 30, 100, 100), res("multi_turn", "rr", 5, 18, 100, 100)}
	rs[0].TTFT99, rs[1].TTFT99 = 300, 900
	path, err := plotWorkload(dir, p, rs, allRouters)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != 2*panelW {
		t.Errorf("plot is %v", b)
	}
	// NaN figures survive a round trip through results.jsonl as null.
	file := filepath.Join(dir, "results.jsonl")
	if err := saveResults(file, rs); err != nil {
		t.Fatal(err)
	}
	back, err := loadResults(file)
	if err != nil {
		t.Fatal(err)
	}
	if len(back) != 3 || back[1].TTFT99 != 900 || back[2].TTFT99.known() || back[0].Goodput != 20 {
		t.Errorf("loaded %+v", back)
	}
	var out bytes.Buffer
	printWorkload(&out, p, rs, allRouters)
	if !strings.Contains(out.String(), "| 10 | pdq | 100 | 0 | 30.0 | 100 % | – | 900 | – | – (–) | – | – |") {
		t.Errorf("table:\n%s", out.String())
	}
}

// The whole tool, small: one workload at one rate, through pdq and the
// round-robin proxy, with a second of arrivals a run (make test runs it
// beside the whole suite; TestTargets and the other unit tests check the
// arithmetic of every workload).
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds pdq and runs a cluster")
	}
	t.Chdir("../..")
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	err := run([]string{"-quick", "-duration", "1", "-workloads", "prefix_repetition", "-routers", "pdq,rr", "-out", dir},
		&stdout, &stderr)
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"## prefix_repetition", "## Against the targets", "| all |"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
	rs, err := loadResults(filepath.Join(dir, "results.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 {
		t.Errorf("%d runs, want 2 (one a router)", len(rs))
	}
	for _, r := range rs {
		if r.Completed == 0 {
			t.Errorf("%s %s %s: nothing completed", r.Workload, r.Variant, r.Router)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "bench-cluster-prefix_repetition.png")); err != nil {
		t.Error(err)
	}
}

func TestCPU(t *testing.T) {
	stat := "cpu  100 5 50 1000 20 3 2 1 40 0\ncpu0 50 2 25 500 10 1 1 0 20 0\n"
	if busy, ok := machineBusy(stat); !ok || busy != 161 {
		t.Errorf("machineBusy = %v, %v; want 161 (user, nice, system, irq, softirq, steal)", busy, ok)
	}
	if _, ok := machineBusy("intr 1 2 3"); ok {
		t.Error("not a cpu line")
	}
	// The command name may hold spaces and parentheses.
	stat = "1234 (pdq (sim) x) S 1 1234 1234 0 -1 4194304 100 0 0 0 250 70 0 0 20 0 12 0 100"
	if ticks, ok := processTicks(stat); !ok || ticks != 320 {
		t.Errorf("processTicks = %v, %v; want 320", ticks, ok)
	}
	// 2 s: the machine busy 300 ticks, the benchmark 200: half a CPU
	// elsewhere.
	if got := otherCPU(cpuSample{busy: 1000, ours: 500, ok: true}, cpuSample{busy: 1300, ours: 700, ok: true}, 2); got != 0.5 {
		t.Errorf("otherCPU = %v, want 0.5", got)
	}
	if otherCPU(cpuSample{}, cpuSample{ok: true}, 2).known() {
		t.Error("a sample that failed gives no figure")
	}
	if s := sampleCPU(nil); !s.ok || s.ours <= 0 && s.busy <= 0 {
		t.Errorf("sampleCPU of this process: %+v", s)
	}
	var out bytes.Buffer
	a, b := res("random", "pdq", 20, 1, 1, 1), res("random", "rr", 20, 1, 1, 1)
	a.OtherCPU, b.OtherCPU = 0.05, 0.9
	printMachine(&out, []result{a, b})
	if !strings.Contains(out.String(), "during 1 of 2 runs: random at 20 through round-robin proxy (0.90)") {
		t.Errorf("printMachine: %s", out.String())
	}
	var many []result
	for i := range 12 {
		r := res("random", "pdq", float64(i), 1, 1, 1)
		r.OtherCPU = num(float64(i) / 10)
		many = append(many, r)
	}
	out.Reset()
	printMachine(&out, many)
	if !strings.Contains(out.String(), "during 9 of 12 runs (a median of 0.60 CPU over all runs, at most 1.10)") {
		t.Errorf("printMachine: %s", out.String())
	}
}
