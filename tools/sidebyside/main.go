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
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/pdq-dev/pdq/tools/internal/proc"
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
	if err := proc.Build(".", "./cmd/pdq", head); err != nil {
		return err
	}
	proxy := filepath.Join(o.work, "pdproxy")
	if err := proc.Build(".", "./tools/pdproxy", proxy); err != nil {
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
