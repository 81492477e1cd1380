// Command sidebyside is `make bench`: it runs one load, with one seed,
// against a decode engine alone, the floor (a client that drives both legs
// itself), a plain P/D proxy (tools/pdproxy: a router with no queue), pdq
// up at HEAD and pdq up built from a baseline commit, all in front of the
// same `pdq sim` engines, and prints a table per concurrency.
//
// The load generator is `pdq bench` (vLLM's bench serve flags); the
// routers' processes are measured from /proc: CPU seconds (the scheduler's
// nanoseconds, or user and system ticks where it has none) and peak RSS,
// per 1,000 requests. Each run starts a fresh pdq up, so its
// peak RSS is its own.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	pdqbench "github.com/pdq-dev/pdq/pkg/bench"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "sidebyside:", err)
		os.Exit(1)
	}
}

// profile is a set of engine latencies, and the load run against them.
type profile struct {
	name string
	sim  []string // pdq sim latency flags
	// prompts per run, by concurrency: enough for stable percentiles, few
	// enough to keep make bench within minutes.
	prompts func(concurrency int) int
	// The rest are set by the profiles that run a load of their own
	// instead of -concurrency, -input-len and -output-len.
	concurrency         []int
	inputLen, outputLen int
	upEnv               []string // more pdq up settings
	pdqOnly             bool     // run the pdq targets only
	noWarmUp            bool
}

var profiles = map[string]profile{
	"zero": {
		name: "zero-latency engines (pdq's own overhead)",
		sim:  []string{"--prefill-overhead", "0s", "--prefill-per-token", "0s", "--kv-transfer-per-block", "0s", "--itl", "0s"},
		prompts: func(c int) int {
			return map[int]int{1: 200, 16: 800, 64: 1500, 256: 2000}[c]
		},
	},
	"realistic": {
		name: "realistic engines (TTFT 200 ms, ITL 10 ms)",
		sim:  []string{"--prefill-overhead", "200ms", "--prefill-per-token", "0s", "--kv-transfer-per-block", "0s", "--itl", "10ms"},
		prompts: func(c int) int {
			return map[int]int{1: 20, 16: 128, 64: 512, 256: 512}[c]
		},
	},
	// A 400 KB prompt: 81,000 words of about five bytes each, a 400 KiB
	// body (its mean, for the default seed), one at a time. pdq's own
	// cost of a long body (reading, checking, two queue hops, two engine
	// bodies) shows as added TTFT and bytes allocated.
	"long": {
		name:        "400 KB prompts, zero-latency engines",
		sim:         []string{"--prefill-overhead", "0s", "--prefill-per-token", "0s", "--kv-transfer-per-block", "0s", "--itl", "0s", "--max-model-len", "200000"},
		prompts:     func(int) int { return 60 },
		concurrency: []int{1},
		inputLen:    81000, outputLen: 8,
	},
	// 1,000 streams in flight at once: pdq's peak RSS with a fresh start.
	"streams": {
		name:        "1,000 streams in flight (ITL 10 ms, 300 tokens each)",
		sim:         []string{"--prefill-overhead", "0s", "--prefill-per-token", "0s", "--kv-transfer-per-block", "0s", "--itl", "10ms", "--max-num-seqs", "2048"},
		prompts:     func(int) int { return 1000 },
		concurrency: []int{1000},
		inputLen:    256, outputLen: 300,
		upEnv:   []string{"PDQ_ENGINE_SLOTS=1024", "PDQ_MAX_QUEUE=4096"},
		pdqOnly: true, noWarmUp: true,
	},
}

type options struct {
	base        string
	profiles    []string
	concurrency []int
	inputLen    int
	outputLen   int
	seed        int
	repeat      int // runs of each target per table; the table shows medians
	work        string
}

func run() error {
	var o options
	var profs, conc string
	flag.StringVar(&o.base, "base", "62e80c5", "baseline commit to build pdq from")
	flag.StringVar(&profs, "profiles", "zero,realistic,long,streams", "engine latency profiles: zero, realistic, long (400 KB prompts), streams (1,000 in flight)")
	flag.StringVar(&conc, "concurrency", "1,16,64,256", "concurrencies, one table each")
	flag.IntVar(&o.inputLen, "input-len", 256, "prompt words (tokens for pdq sim)")
	flag.IntVar(&o.outputLen, "output-len", 32, "streamed tokens per request")
	flag.IntVar(&o.seed, "seed", 0, "pdq bench --seed")
	flag.IntVar(&o.repeat, "repeat", 1, "runs of each target per table, in alternating order; the table shows each column's median")
	flag.Parse()
	o.profiles = strings.Split(profs, ",")
	for _, c := range strings.Split(conc, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(c))
		if err != nil || n < 1 {
			return fmt.Errorf("-concurrency: %q is not a positive number", c)
		}
		o.concurrency = append(o.concurrency, n)
	}
	for _, p := range o.profiles {
		if _, ok := profiles[p]; !ok {
			return fmt.Errorf("-profiles: unknown profile %q", p)
		}
	}
	var err error
	if o.work, err = os.MkdirTemp("", "pdq-bench-"); err != nil {
		return err
	}
	defer os.RemoveAll(o.work)

	head := filepath.Join(o.work, "pdq-head")
	if err := goBuild(".", "./cmd/pdq", head); err != nil {
		return err
	}
	proxy := filepath.Join(o.work, "pdproxy")
	if err := goBuild(".", "./tools/pdproxy", proxy); err != nil {
		return err
	}
	base, err := buildBase(o)
	if err != nil {
		return err
	}
	fmt.Printf("pdq side by side: HEAD %s vs %s; %d-token prompts, %d streamed tokens, seed %d; %s\n",
		revision("HEAD"), revision(o.base), o.inputLen, o.outputLen, o.seed, machine())
	m := measured{}
	for _, name := range o.profiles {
		if err := runProfile(o, name, bins{head: head, base: base, proxy: proxy}, m); err != nil {
			return err
		}
	}
	printTargets(m, revision(o.base))
	return nil
}

// bins are the binaries a run starts: pdq at HEAD (also the engines and
// the load), pdq at BASE, and the plain proxy.
type bins struct{ head, base, proxy string }

// target is one way of serving the load.
type target struct {
	name  string
	pdq   string // the pdq binary to run as pdq up
	proxy string // the plain proxy's binary
	pd    bool   // the floor: pdq bench drives both legs
}

// router says whether t runs a process of its own in front of the
// engines, whose CPU and memory are measured.
func (t target) router() bool { return t.pdq != "" || t.proxy != "" }

// result is what one run measured.
type result struct {
	bench bench
	cpu   time.Duration // pdq's user and system CPU
	rss   int64         // pdq's peak RSS, bytes
	alloc float64       // bytes pdq allocated over the run; 0: not known
}

func runProfile(o options, key string, b bins, m measured) error {
	p := profiles[key]
	fmt.Printf("\n## %s\n", p.name)
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	prefill, psim, err := startSim(ctx, b.head, p.sim)
	if err != nil {
		return err
	}
	defer stop(psim)
	decode, dsim, err := startSim(ctx, b.head, p.sim)
	if err != nil {
		return err
	}
	defer stop(dsim)
	targets := []target{
		{name: "decode engine alone"},
		{name: "floor (client drives P and D)", pd: true},
		{name: "plain P/D proxy", proxy: b.proxy},
		{name: "pdq " + o.base, pdq: b.base},
		{name: "pdq HEAD", pdq: b.head},
	}
	if p.pdqOnly {
		targets = targets[3:]
	}
	conc := o.concurrency
	if p.concurrency != nil {
		conc = p.concurrency
	}
	if p.inputLen > 0 {
		o.inputLen, o.outputLen = p.inputLen, p.outputLen
	}
	for k, c := range conc {
		n := p.prompts(c)
		if n == 0 {
			n = 4 * c
		}
		runs := make([][]result, len(targets))
		// Every other round runs the targets in reverse, so that none of
		// them always runs first on a cold engine, or last on a warm
		// machine.
		for round := range max(o.repeat, 1) {
			for j := range targets {
				i := j
				if (k+round)%2 == 1 {
					i = len(targets) - 1 - j
				}
				r, err := runTarget(ctx, o, p, targets[i], b.head, prefill, decode, c, n)
				if err != nil {
					return fmt.Errorf("%s at concurrency %d: %w", targets[i].name, c, err)
				}
				runs[i] = append(runs[i], r)
			}
		}
		results := make([]result, len(targets))
		for i := range targets {
			results[i] = medianResult(runs[i])
		}
		t := tableOf(results, p.pdqOnly)
		printTable(c, n, len(runs[0]), targets, results, t)
		if t.bodyBytes, err = meanBodyBytes(o, n); err != nil {
			return err
		}
		m.add(key, c, t)
	}
	return nil
}

// tableOf picks the floor, the plain proxy, BASE and HEAD out of the
// results of one table, in the order of runProfile's targets: the decode
// engine alone, the floor, the plain proxy, BASE, HEAD; or BASE and HEAD
// alone for a pdq-only profile.
func tableOf(results []result, pdqOnly bool) table {
	n := len(results)
	t := table{base: &results[n-2], head: &results[n-1]}
	if !pdqOnly {
		t.floor, t.proxy = &results[1], &results[2]
	}
	return t
}

// meanBodyBytes is the mean size of the n request bodies pdq bench sends
// with o's lengths and seed: the dataset runTarget's flags ask for (no
// prefix, no range ratio), with the openai-chat backend's body.
func meanBodyBytes(o options, n int) (float64, error) {
	reqs, err := pdqbench.RandomDataset{InputLen: o.inputLen, OutputLen: o.outputLen, Seed: uint64(o.seed)}.Sample(n, "")
	if err != nil {
		return 0, err
	}
	var sum int
	for _, r := range reqs {
		b, err := pdqbench.ChatBody("pdq-sim", r)
		if err != nil {
			return 0, err
		}
		sum += len(b)
	}
	return float64(sum) / float64(len(reqs)), nil
}

func runTarget(ctx context.Context, o options, p profile, t target, head, prefill, decode string, concurrency, n int) (result, error) {
	url := decode
	var up *exec.Cmd
	var err error
	switch {
	case t.pdq != "":
		if up, url, err = startUp(ctx, t.pdq, o.work, prefill, decode, p.upEnv); err != nil {
			return result{}, err
		}
		defer stop(up)
	case t.proxy != "":
		if up, url, err = startProxy(ctx, t.proxy, prefill, decode); err != nil {
			return result{}, err
		}
		defer stop(up)
	}
	args := func(prompts int, file string) []string {
		a := []string{"bench", "--base-url", url, "--backend", "openai-chat", "--model", "pdq-sim",
			"--dataset-name", "random", "--random-input-len", strconv.Itoa(o.inputLen), "--random-output-len", strconv.Itoa(o.outputLen),
			"--num-prompts", strconv.Itoa(prompts), "--max-concurrency", strconv.Itoa(concurrency), "--ignore-eos",
			"--seed", strconv.Itoa(o.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
			"--disable-tqdm"}
		if t.pd {
			a = append(a, "--pd-prefill", prefill)
		}
		if file != "" {
			// Measured: no test run inside the CPU window (the warm-up has
			// run).
			a = append(a, "--save-result", "--result-filename", file, "--ready-check-timeout-sec", "0")
		}
		return a
	}
	// A warm-up: connections, JIT-free but cache-warm.
	if !p.noWarmUp {
		if out, err := exec.CommandContext(ctx, head, args(min(n, 2*concurrency), "")...).CombinedOutput(); err != nil {
			return result{}, fmt.Errorf("warm-up: %w\n%s", err, out)
		}
	}
	var cpu0 time.Duration
	var alloc0 float64
	if up != nil {
		// The scrape of /metrics first, so that its own work falls
		// outside the window, as the second one does.
		alloc0 = allocated(url)
		cpu0, _, _ = procStats(up.Process.Pid)
	}
	file := filepath.Join(o.work, "result.json")
	if out, err := exec.CommandContext(ctx, head, args(n, file)...).CombinedOutput(); err != nil {
		return result{}, fmt.Errorf("pdq bench: %w\n%s", err, out)
	}
	raw, err := os.ReadFile(file)
	if err != nil {
		return result{}, err
	}
	var r result
	if err := json.Unmarshal(raw, &r.bench); err != nil {
		return result{}, fmt.Errorf("read %s: %w", file, err)
	}
	if up != nil {
		cpu1, rss, err := procStats(up.Process.Pid)
		if err != nil {
			return result{}, err
		}
		r.cpu, r.rss = cpu1-cpu0, rss
		if alloc0 > 0 {
			r.alloc = allocated(url) - alloc0
		}
	}
	return r, nil
}

// allocated reads the bytes pdq up has allocated so far from its
// /metrics (go_memstats_alloc_bytes_total); 0 when it exports none (a
// baseline from before the Go collector).
func allocated(url string) float64 {
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "go_memstats_alloc_bytes_total "); ok {
			f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f
		}
	}
	return 0
}

// bench holds the fields of pdq bench's result file (vLLM's names).
type bench struct {
	Completed         int     `json:"completed"`
	Failed            int     `json:"failed"`
	Duration          float64 `json:"duration"`
	RequestThroughput float64 `json:"request_throughput"`
	OutputThroughput  float64 `json:"output_throughput"`
	P50TTFT           float64 `json:"p50_ttft_ms"`
	P99TTFT           float64 `json:"p99_ttft_ms"`
	P50ITL            float64 `json:"p50_itl_ms"`
	P99ITL            float64 `json:"p99_itl_ms"`
}

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

// buildBase builds pdq at the baseline commit, in a worktree of its own.
func buildBase(o options) (string, error) {
	dir := filepath.Join(o.work, "base")
	if out, err := exec.Command("git", "worktree", "add", "--detach", dir, o.base).CombinedOutput(); err != nil {
		return "", fmt.Errorf("git worktree add %s: %w\n%s", o.base, err, out)
	}
	defer exec.Command("git", "worktree", "remove", "--force", dir).Run()
	bin := filepath.Join(o.work, "pdq-base")
	return bin, goBuild(dir, "./cmd/pdq", bin)
}

func goBuild(dir, pkg, out string) error {
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = dir
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build in %s: %w\n%s", dir, err, b)
	}
	return nil
}

func revision(rev string) string {
	out, err := exec.Command("git", "rev-parse", "--short", rev).Output()
	if err != nil {
		return rev
	}
	return strings.TrimSpace(string(out))
}

func machine() string {
	cpus := 0
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		cpus = strings.Count(string(b), "processor\t:")
	}
	return fmt.Sprintf("%d CPUs", cpus)
}

// startSim runs pdq sim on free loopback ports and returns its URL and
// process.
func startSim(ctx context.Context, bin string, latency []string) (string, *exec.Cmd, error) {
	port, err := freePort()
	if err != nil {
		return "", nil, err
	}
	args := append([]string{"sim", "--addr", "127.0.0.1:" + strconv.Itoa(port), "--kv-host", "127.0.0.1", "--kv-port", "0",
		"--max-num-seqs", "1024"}, latency...)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "PDQ_LOG_LEVEL=warn")
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	if err := waitHTTP(url + "/health"); err != nil {
		stop(cmd)
		return "", nil, err
	}
	return url, cmd, nil
}

// startUp runs pdq up in front of the engines and returns its URL.
func startUp(ctx context.Context, bin, work, prefill, decode string, env []string) (*exec.Cmd, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	data, err := os.MkdirTemp(work, "data-")
	if err != nil {
		return nil, "", err
	}
	cmd := exec.CommandContext(ctx, bin, "up")
	cmd.Env = append(os.Environ(), "PDQ_HTTP_ADDR=127.0.0.1:"+strconv.Itoa(port), "PDQ_DATA_DIR="+data,
		"PDQ_PREFILL_ENGINES="+prefill, "PDQ_DECODE_ENGINES="+decode, "PDQ_LOG_LEVEL=warn", "PDQ_LOG_FORMAT=json",
		"PDQ_ENGINE_SLOTS=256")
	cmd.Env = append(cmd.Env, env...) // later settings win
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	if err := waitServing(url); err != nil {
		stop(cmd)
		return nil, "", err
	}
	return cmd, url, nil
}

// startProxy runs the plain proxy in front of the engines and returns its
// URL.
func startProxy(ctx context.Context, bin, prefill, decode string) (*exec.Cmd, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	cmd := exec.CommandContext(ctx, bin, "-addr", strings.TrimPrefix(url, "http://"), "-prefill", prefill, "-decode", decode)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	if err := waitServing(url); err != nil {
		stop(cmd)
		return nil, "", err
	}
	return cmd, url, nil
}

// waitServing waits until a router (pdq up, the plain proxy) answers a
// request through both legs.
func waitServing(url string) error {
	deadline := time.Now().Add(30 * time.Second)
	body := `{"model":"pdq-sim","prompt":"` + strings.Repeat("word ", 64) + `","max_tokens":1}`
	client := &http.Client{Timeout: 5 * time.Second}
	for time.Now().Before(deadline) {
		resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s did not serve within 30 s", url)
}

func waitHTTP(url string) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := client.Get(url); err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s did not answer within 10 s", url)
}

func stop(cmd *exec.Cmd) {
	cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// procStats reads a process's CPU time (user and system) and peak RSS.
func procStats(pid int) (time.Duration, int64, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// Fields after the command name, which is in parentheses.
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	if len(fields) < 13 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	const ticks = 100 // USER_HZ on Linux
	cpu := time.Duration(utime+stime) * time.Second / ticks
	// The same in nanoseconds, where the scheduler's statistics are on:
	// user and system time come in 10 ms ticks, and a run of a few dozen
	// requests takes only a few dozen of them. A thread that ended is not
	// in the sum; the Go runtime rarely ends one.
	if tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid)); err == nil && len(tasks) > 0 {
		var ns int64
		for _, task := range tasks {
			if b, err := os.ReadFile(task); err == nil {
				if f := strings.Fields(string(b)); len(f) > 0 {
					n, _ := strconv.ParseInt(f[0], 10, 64)
					ns += n
				}
			}
		}
		if ns > 0 {
			cpu = time.Duration(ns)
		}
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	var rss int64
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			rss = kb << 10
		}
	}
	return cpu, rss, nil
}
