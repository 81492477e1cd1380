package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	pdqbench "github.com/pdq-dev/pdq/pkg/bench"
)

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
