package bench

import (
	"errors"
	"flag"
	"io"
	"math"
	"slices"
	"testing"
)

func TestJoinNargs(t *testing.T) {
	tests := []struct {
		in, want []string
	}{
		{[]string{"--goodput", "ttft:500", "tpot:50", "--num-prompts", "8"}, []string{"--goodput=ttft:500 tpot:50", "--num-prompts", "8"}},
		{[]string{"-goodput=ttft:1", "e2el:2"}, []string{"--goodput=ttft:1 e2el:2"}},
		{[]string{"--num-prompts", "8", "--ignore-eos"}, []string{"--num-prompts", "8", "--ignore-eos"}},
		{[]string{"--", "--goodput", "x"}, []string{"--", "--goodput", "x"}},
	}
	for _, tt := range tests {
		if got := JoinNargs(tt.in); !slices.Equal(got, tt.want) {
			t.Errorf("JoinNargs(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func parse(t *testing.T, args ...string) Config {
	t.Helper()
	c := DefaultConfig()
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	if err := fs.Parse(JoinNargs(args)); err != nil {
		t.Fatalf("parse %q: %v", args, err)
	}
	return c
}

func TestFlagsDefaults(t *testing.T) {
	c := parse(t)
	s, err := c.check()
	if err != nil {
		t.Fatal(err)
	}
	if s.apiURL != "http://127.0.0.1:8000/v1/completions" || c.NumPrompts != 1000 || c.RandomInputLen != 1024 ||
		c.RandomOutputLen != 128 || !math.IsInf(c.RequestRate, 1) || c.Burstiness != 1 || c.Seed != 0 ||
		c.MaxConcurrency != 0 || !slices.Equal(s.percentileMetrics, []string{"ttft", "tpot", "itl"}) ||
		!slices.Equal(s.percentiles, []float64{99}) || s.goodput.set() {
		t.Errorf("defaults: %+v %+v", c, s)
	}
	if len(c.RequestIDPrefix) != len("bench-12345678-") {
		t.Errorf("request id prefix %q", c.RequestIDPrefix)
	}
}

func TestFlags(t *testing.T) {
	c := parse(t, "--backend", "openai-chat", "--host", "::1", "--port", "9", "--request-rate", "2.5",
		"--goodput", "ttft:500", "tpot:50", "--max-concurrency", "3", "--metric-percentiles", "50,99.9",
		"--percentile-metrics", "e2el,ttft", "--pd-prefill", "http://p:1/")
	s, err := c.check()
	if err != nil {
		t.Fatal(err)
	}
	if s.apiURL != "http://[::1]:9/v1/chat/completions" || s.prefillURL != "http://p:1/v1/chat/completions" || !s.chat {
		t.Errorf("urls %q %q", s.apiURL, s.prefillURL)
	}
	if *s.goodput.TTFT != 500 || *s.goodput.TPOT != 50 || s.goodput.E2EL != nil {
		t.Errorf("goodput %+v", s.goodput)
	}
	if c.MaxConcurrency != 3 || c.RequestRate != 2.5 || !slices.Equal(s.percentiles, []float64{50, 99.9}) {
		t.Errorf("config %+v", c)
	}
	if c := parse(t, "--request-rate", "inf"); !math.IsInf(c.RequestRate, 1) {
		t.Errorf("--request-rate inf gave %v", c.RequestRate)
	}
}

func TestFlagsInvalid(t *testing.T) {
	for _, args := range [][]string{
		{"--backend", "tgi"},
		{"--dataset-name", "sharegpt"},
		{"--goodput", "ttft=5"},
		{"--goodput", "itl:5"},
		{"--goodput", "ttft:-1"},
		{"--percentile-metrics", "ttft,p99"},
		{"--metric-percentiles", "101"},
		{"--backend", "openai-chat", "--endpoint", "/v1/completions"},
		{"--endpoint", "/v1/embeddings"},
		{"--request-rate", "0"},
		{"--burstiness", "0"},
		{"--num-prompts", "0"},
		{"--seed", "-1"},
	} {
		c := parse(t, args...)
		if _, err := c.check(); !errors.Is(err, ErrInvalid) {
			t.Errorf("%q: err %v, want ErrInvalid", args, err)
		}
	}
	c := DefaultConfig()
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"--max-concurrency", "0"}); err == nil {
		t.Error("--max-concurrency 0 was taken")
	}
}
