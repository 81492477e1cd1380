package bench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/bench"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// blockLine is a line of the result block: a label padded to 40, a space,
// a value padded to 10.
var blockLine = regexp.MustCompile(`^(.{40}) (\S+) *$`)

// parseBlock reads the result block out of out into label → value, and
// fails the test unless it is framed as vLLM frames it.
func parseBlock(t *testing.T, out string) map[string]string {
	t.Helper()
	const title = "============ Serving Benchmark Result ============"
	i := strings.Index(out, title+"\n")
	if i < 0 {
		t.Fatalf("no result block in:\n%s", out)
	}
	lines := strings.Split(strings.TrimSuffix(out[i:], "\n"), "\n")
	if lines[len(lines)-1] != strings.Repeat("=", 50) {
		t.Fatalf("block does not end with 50 '=':\n%s", out[i:])
	}
	vals := map[string]string{}
	for _, l := range lines[1 : len(lines)-1] {
		if len(l) == 50 && strings.HasPrefix(l, "-") && strings.HasSuffix(l, "-") {
			continue // a section header
		}
		m := blockLine.FindStringSubmatch(l)
		if m == nil {
			t.Fatalf("line %q is not vLLM's format", l)
		}
		vals[strings.TrimSpace(m[1])] = m[2]
	}
	return vals
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return n
}

func TestBenchAgainstSim(t *testing.T) {
	engine := simtest.Start(t, simtest.FastConfig())
	dir := t.TempDir()
	cfg := bench.DefaultConfig()
	cfg.BaseURL = engine.URL
	cfg.NumPrompts = 8
	cfg.RandomInputLen = 40
	cfg.RandomOutputLen = 16
	cfg.PercentileMetrics = "ttft,tpot,itl,e2el"
	cfg.SaveResult = true
	cfg.ResultDir = dir
	cfg.ResultFilename = "r.json"
	var out strings.Builder
	res, err := bench.Run(context.Background(), cfg, &out, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "First model name: pdq-sim, first model id: pdq-sim\n") {
		t.Errorf("the model was not taken from /v1/models:\n%s", out.String())
	}
	v := parseBlock(t, out.String())
	if v["Successful requests:"] != "8" || v["Failed requests:"] != "0" {
		t.Fatalf("requests: %v\n%s", v, out.String())
	}
	if got := atoi(t, v["Total generated tokens:"]); got != 8*16 {
		t.Errorf("Total generated tokens: %d, want %d", got, 8*16)
	}
	if got := atoi(t, v["Total input tokens:"]); got != 8*40 {
		t.Errorf("Total input tokens: %d, want %d (one per word)", got, 8*40)
	}
	for _, label := range []string{"Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):", "Peak concurrent requests:"} {
		if _, err := strconv.ParseFloat(v[label], 64); err != nil || !strings.Contains(v[label], ".") {
			t.Errorf("%s %q is not a .2f number", label, v[label])
		}
	}
	s := engine.Stats(t)
	// The eight, and the initial test run (the first prompt once more).
	if s.Requests != 9 || s.GenerationTokens != 9*16 || s.PromptTokens != 9*40 {
		t.Errorf("engine stats %+v", s)
	}

	// The result file is vLLM's JSON.
	b, err := os.ReadFile(filepath.Join(dir, "r.json"))
	if err != nil {
		t.Fatal(err)
	}
	if res.File != filepath.Join(dir, "r.json") {
		t.Errorf("result file %q", res.File)
	}
	var r map[string]any
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("result file: %v\n%s", err, b)
	}
	want := map[string]any{
		"backend": "openai", "endpoint_type": "openai", "model_id": "pdq-sim", "num_prompts": 8.0,
		"request_rate": "inf", "burstiness": 1.0, "max_concurrency": nil, "completed": 8.0, "failed": 0.0,
		"total_input_tokens": 320.0, "total_output_tokens": 128.0, "request_goodput": nil,
	}
	for k, w := range want {
		if r[k] != w {
			t.Errorf("result %s = %v, want %v", k, r[k], w)
		}
	}
	for _, k := range []string{"date", "duration", "mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_e2el_ms", "latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests"} {
		if _, ok := r[k]; !ok {
			t.Errorf("result has no %s", k)
		}
	}
	for _, k := range []string{"ttfts", "itls", "generated_texts", "errors", "input_lens", "output_lens", "start_times"} {
		if _, ok := r[k]; ok {
			t.Errorf("result has %s without --save-detailed", k)
		}
	}
	if !strings.HasPrefix(string(b), `{"date": "`) {
		t.Errorf("result file is not written as Python writes it: %.40s", b)
	}
}

func TestBenchPDAgainstSims(t *testing.T) {
	prefill := simtest.Start(t, simtest.FastConfig())
	decode := simtest.Start(t, simtest.FastConfig())
	cfg := bench.DefaultConfig()
	cfg.BaseURL = decode.URL
	cfg.PDPrefill = prefill.URL
	cfg.Model = "pdq-sim"
	cfg.Backend = "openai-chat"
	cfg.NumPrompts = 8
	cfg.RandomInputLen = 40
	cfg.RandomOutputLen = 8
	cfg.RequestRate = 200
	cfg.MaxConcurrency = 3
	var out strings.Builder
	res, err := bench.Run(context.Background(), cfg, &out, nil)
	if err != nil {
		t.Fatal(err)
	}
	v := parseBlock(t, out.String())
	if v["Successful requests:"] != "8" || v["Maximum request concurrency:"] != "3" || v["Request rate configured (RPS):"] != "200.00" {
		t.Fatalf("block: %v\n%s", v, out.String())
	}
	if got := atoi(t, v["Total generated tokens:"]); got != 8*8 {
		t.Errorf("Total generated tokens: %d, want %d", got, 8*8)
	}
	ps := prefill.WaitStats(t, 5*time.Second, "prefills", func(s sim.Stats) bool { return s.KVServed == 9 })
	ds := decode.Stats(t)
	if ps.Prefills != 9 || ds.Decodes != 9 || ds.KVReads != 9 || ds.Local != 0 || ds.RequestIDMismatches != 0 {
		t.Errorf("prefill stats %+v\ndecode stats %+v", ps, ds)
	}
	for _, o := range res.Outputs {
		if o.TTFT <= 0 || o.Latency < o.TTFT {
			t.Errorf("output %+v", o)
		}
	}
}

// TestChatBodyIsWhatBenchSends checks ChatBody, by which make bench sizes
// its load, against the bodies the engine received from a run with the
// same dataset.
func TestChatBodyIsWhatBenchSends(t *testing.T) {
	engine := simtest.Start(t, simtest.FastConfig())
	cfg := bench.DefaultConfig()
	cfg.BaseURL, cfg.Backend, cfg.Model = engine.URL, "openai-chat", "pdq-sim"
	cfg.NumPrompts, cfg.RandomInputLen, cfg.RandomOutputLen, cfg.Seed = 3, 30, 4, 5
	cfg.RequestIDPrefix = "cb-"
	if _, err := bench.Run(context.Background(), cfg, io.Discard, nil); err != nil {
		t.Fatal(err)
	}
	reqs, err := bench.RandomDataset{InputLen: 30, OutputLen: 4, Seed: 5}.Sample(3, "cb-")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs {
		want, err := bench.ChatBody("pdq-sim", r)
		if err != nil {
			t.Fatal(err)
		}
		got := engine.Requests(t, r.RequestID)
		if len(got) != 1 || !bytes.Equal(got[0].Body, want) {
			t.Errorf("%s: the engine received %d requests; want one body of\n%s", r.RequestID, len(got), want)
		}
	}
}

// TestBenchVLLMFlags: the flags of vllm bench serve that pdq bench once
// refused are taken: --input-len and --output-len (the dataset's lengths),
// --num-warmups (requests run before the measured ones, not counted),
// --tokenizer (none is loaded: said once, and the run goes on with words),
// and --ready-check-timeout-sec, with vLLM's initial test run before it
// all: a run whose first request cannot succeed stops there.
func TestBenchVLLMFlags(t *testing.T) {
	engine := simtest.Start(t, simtest.FastConfig())
	run := func(args ...string) (string, error) {
		cfg := bench.DefaultConfig()
		fs := flag.NewFlagSet("bench", flag.ContinueOnError)
		cfg.RegisterFlags(fs)
		if err := fs.Parse(bench.JoinNargs(append([]string{"--base-url", engine.URL, "--num-prompts", "5"}, args...))); err != nil {
			t.Fatalf("flags %q: %v", args, err)
		}
		var out strings.Builder
		_, err := bench.Run(context.Background(), cfg, &out, nil)
		return out.String(), err
	}

	out, err := run("--input-len", "30", "--output-len", "4", "--num-warmups", "3", "--tokenizer", "meta-llama/Llama-3.1-8B")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"Starting initial single prompt test run...\n", "Initial test run completed.\n",
		"Warming up with 3 requests...\n", "Warmup run completed.\n", "Starting main benchmark run...\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in:\n%s", want, out)
		}
	}
	if strings.Count(out, "meta-llama/Llama-3.1-8B") != 1 || !strings.Contains(out, "no tokenizer") {
		t.Errorf("--tokenizer: want one line saying none is loaded:\n%s", out)
	}
	v := parseBlock(t, out)
	if v["Successful requests:"] != "5" || atoi(t, v["Total input tokens:"]) != 5*30 || atoi(t, v["Total generated tokens:"]) != 5*4 {
		t.Errorf("the measured run: %v\n%s", v, out)
	}
	if s := engine.Stats(t); s.Requests != 5+1+3 || s.PromptTokens != 9*30 {
		t.Errorf("engine stats %+v: want the 5, the test run and 3 warmups, of 30 tokens each", s)
	}

	out, err = run("--model", "no-such-model", "--ready-check-timeout-sec", "1")
	if err == nil || !strings.Contains(err.Error(), "Initial test run failed") || strings.Contains(out, "Serving Benchmark Result") {
		t.Errorf("a run whose test request fails: %v\n%s", err, out)
	}
	before := engine.Stats(t).Requests
	out, err = run("--ready-check-timeout-sec", "0", "--input-len", "20", "--output-len", "2")
	if err != nil || !strings.Contains(out, "Skipping endpoint ready check.\n") {
		t.Errorf("--ready-check-timeout-sec 0: %v\n%s", err, out)
	}
	if got := engine.Stats(t).Requests - before; got != 5 {
		t.Errorf("with the ready check skipped the engine saw %d requests, want 5", got)
	}
}
