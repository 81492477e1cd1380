package bench_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/bench"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

func TestPrefixRepetitionDataset(t *testing.T) {
	d := bench.PrefixRepetitionDataset{PrefixLen: 30, SuffixLen: 10, NumPrefixes: 3, OutputLen: 7, Seed: 4}
	reqs, err := d.Sample(10, "p-")
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 9 {
		t.Fatalf("%d requests, want 3 prefixes × (10 / 3)", len(reqs))
	}
	byPrefix := map[string]int{}
	for i, r := range reqs {
		words := strings.Fields(r.Prompt)
		if len(words) != 40 || r.PromptLen != 40 || r.OutputLen != 7 {
			t.Fatalf("request %d: %d words, PromptLen %d, OutputLen %d; want 40, 40, 7", i, len(words), r.PromptLen, r.OutputLen)
		}
		byPrefix[strings.Join(words[:30], " ")]++
	}
	if len(byPrefix) != 3 {
		t.Fatalf("%d distinct prefixes, want 3", len(byPrefix))
	}
	for p, n := range byPrefix {
		if n != 3 {
			t.Errorf("prefix %.20q... starts %d prompts, want 3", p, n)
		}
	}
	if first := strings.Fields(reqs[0].Prompt)[:30]; strings.Join(first, " ") == strings.Join(strings.Fields(reqs[1].Prompt)[:30], " ") &&
		strings.Join(first, " ") == strings.Join(strings.Fields(reqs[2].Prompt)[:30], " ") {
		t.Error("the first three requests share a prefix: not shuffled")
	}
	again, _ := d.Sample(10, "p-")
	if again[5].Prompt != reqs[5].Prompt {
		t.Error("the same seed gave another dataset")
	}
	if _, err := d.Sample(2, "p-"); !errors.Is(err, bench.ErrInvalid) {
		t.Errorf("fewer requests than prefixes: %v, want ErrInvalid", err)
	}
}

func TestParseMix(t *testing.T) {
	for _, tc := range []struct {
		in    string
		names []string
		bad   bool
	}{
		{in: "a:9,b:1", names: []string{"a", "b"}},
		{in: "gold, silver:2", names: []string{"gold", "silver"}},
		{in: "", names: nil},
		{in: "a:0", bad: true},
		{in: "a:x", bad: true},
		{in: "a,a", bad: true},
		{in: ":3", bad: true},
	} {
		m, err := bench.ParseMix("--tenants", tc.in)
		if (err != nil) != tc.bad {
			t.Errorf("%q: err = %v, want error %v", tc.in, err, tc.bad)
			continue
		}
		if !tc.bad && strings.Join(m.Names, ",") != strings.Join(tc.names, ",") {
			t.Errorf("%q: names %v, want %v", tc.in, m.Names, tc.names)
		}
	}
}

// TestWorkloadsAgainstSim runs prefix_repetition with tenants and
// priorities against a batched engine: every request carries its tenant
// and priority, the cached share is the prefix's, and each group is
// reported.
func TestWorkloadsAgainstSim(t *testing.T) {
	batched := simtest.Start(t, func() simconfig.Config {
		c := simtest.FastConfig()
		c.Profile, c.TimeScale, c.PromptTokensDetails, c.SchedulingPolicy = "seed", 0.01, true, "priority"
		return c
	}())
	cfg := bench.DefaultConfig()
	cfg.BaseURL = batched.URL
	cfg.DatasetName = "prefix_repetition"
	cfg.PrefixRepetitionPrefixLen, cfg.PrefixRepetitionSuffixLen = 160, 16
	cfg.PrefixRepetitionNumPrefixes, cfg.PrefixRepetitionOutputLen = 2, 4
	cfg.NumPrompts, cfg.MaxConcurrency = 20, 1
	cfg.Tenants, cfg.Priorities = "a:3,b:1", "0:1,1:1"
	cfg.RequestIDPrefix = "wl-"
	var out strings.Builder
	res, err := bench.Run(context.Background(), cfg, &out, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Report.Metrics.Completed != 20 {
		t.Fatalf("%d of 20 completed:\n%s", res.Report.Metrics.Completed, out.String())
	}
	text := out.String()
	for _, want := range []string{"Cached prompt tokens:", "Cached share of prompt tokens (%):",
		"tenant a", "tenant b", "priority 0", "priority 1", "P99 TTFT (ms):"} {
		if !strings.Contains(text, want) {
			t.Errorf("no %q in:\n%s", want, text)
		}
	}
	counts := map[string]int{}
	for _, g := range res.Groups {
		counts[g.Key+" "+g.Name] = g.Metrics.Completed
	}
	if counts["tenant a"] != 15 || counts["tenant b"] != 5 || counts["priority 0"] != 10 || counts["priority 1"] != 10 {
		t.Errorf("groups %v, want a 15, b 5, priorities 10 and 10", counts)
	}
	cached, prompt := 0, 0
	for _, o := range res.Outputs {
		cached += o.CachedTokens
		prompt += o.PromptLen
	}
	// Each of the 2 prefixes is computed once; 18 requests find its 160
	// tokens (10 full blocks) cached.
	if cached < 18*160 {
		t.Errorf("%d of %d prompt tokens cached, want at least 18 × 160", cached, prompt)
	}
	// The tenant and priority reach the engine in the body.
	recs := batched.Requests(t, "wl-3")
	if len(recs) != 1 || !strings.Contains(string(recs[0].Body), `"user":"`) || !strings.Contains(string(recs[0].Body), `"priority":`) {
		t.Errorf("request wl-3 reached the engine as %+v, want a user and a priority", recs)
	}
}

// TestMultiTurnAgainstSim runs conversations against a batched engine:
// each turn carries the conversation so far, the engine's own answers
// included, so the engine finds the earlier turns in its prefix cache.
func TestMultiTurnAgainstSim(t *testing.T) {
	engine := simtest.Start(t, func() simconfig.Config {
		c := simtest.FastConfig()
		c.Profile, c.TimeScale, c.PromptTokensDetails = "seed", 0.01, true
		return c
	}())
	cfg := bench.DefaultConfig()
	cfg.BaseURL, cfg.Backend = engine.URL, "openai-chat"
	cfg.DatasetName = "multi_turn"
	cfg.NumPrompts, cfg.MultiTurnTurns = 3, 3
	cfg.MultiTurnCommonPrefixLen, cfg.MultiTurnPrefixLen, cfg.MultiTurnUserLen, cfg.MultiTurnOutputLen = 32, 64, 20, 8
	cfg.MultiTurnThinkTime = 0.01
	cfg.RequestIDPrefix = "mt-"
	cfg.Tenants = "a:2,b:1" // by conversation: every turn of one is one tenant's
	var out strings.Builder
	res, err := bench.Run(context.Background(), cfg, &out, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Report.Metrics.Completed != 9 {
		t.Fatalf("%d of 9 turns completed:\n%s", res.Report.Metrics.Completed, out.String())
	}
	for c := range 3 {
		var prevPrompt int
		tenant := ""
		for k := range 3 {
			o := res.Outputs[c*3+k]
			recs := engine.Requests(t, fmt.Sprintf("mt-%d-%d", c, k))
			if len(recs) != 1 {
				t.Fatalf("turn %d-%d reached the engine %d times", c, k, len(recs))
			}
			var body struct {
				User     string `json:"user"`
				Messages []struct {
					Role    string `json:"role"`
					Content []struct {
						Text string `json:"text"`
					} `json:"content"`
				} `json:"messages"`
			}
			if err := json.Unmarshal(recs[0].Body, &body); err != nil {
				t.Fatal(err)
			}
			if k == 0 {
				tenant = body.User
			} else if body.User != tenant || tenant == "" {
				t.Errorf("turn %d-%d is tenant %q's, turn %d-0 %q's: want one tenant a conversation", c, k, body.User, c, tenant)
			}
			if len(body.Messages) != 2*k+1 {
				t.Errorf("turn %d-%d carries %d messages, want %d", c, k, len(body.Messages), 2*k+1)
			}
			if k > 0 {
				prev := res.Outputs[c*3+k-1]
				if got := body.Messages[2*k-1]; got.Role != "assistant" || got.Content[0].Text != prev.GeneratedText {
					t.Errorf("turn %d-%d: the previous answer is %+v, want the engine's %q", c, k, got, prev.GeneratedText)
				}
				if o.CachedTokens < prevPrompt/16*16-16 {
					t.Errorf("turn %d-%d: %d cached tokens, want about the previous prompt's %d", c, k, o.CachedTokens, prevPrompt)
				}
			}
			prevPrompt = o.PromptLen
		}
	}
}
