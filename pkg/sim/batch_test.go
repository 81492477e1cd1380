package sim_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// batched is a batched engine of the seed profile, a hundred times faster
// than the GPU it models, that reports cached tokens.
func batched(mutate func(*simconfig.Config)) simconfig.Config {
	return fast(func(c *simconfig.Config) {
		c.Profile, c.TimeScale, c.PromptTokensDetails = "seed", 0.01, true
		if mutate != nil {
			mutate(c)
		}
	})
}

// words is a prompt of n distinct words (n tokens), starting at from.
func words(n, from int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString("w")
		b.WriteString(strings.Repeat("x", (from+i)%7))
		b.WriteString(string(rune('a' + (from+i)%26)))
		b.WriteString(string(rune('a' + (from+i)/26%26)))
	}
	return b.String()
}

func cached(u *openai.Usage) int {
	if u == nil || u.PromptTokensDetails == nil {
		return 0
	}
	return u.PromptTokensDetails.CachedTokens
}

func TestBatchedPrefixCache(t *testing.T) {
	e := simtest.Start(t, batched(nil))
	prompt := words(200, 0)
	first := completion(t, e, map[string]any{"model": "pdq-sim", "prompt": prompt, "max_tokens": 4, "ignore_eos": true})
	if c := cached(first.Usage); c != 0 {
		t.Errorf("first request: %d cached tokens, want 0 (and no prompt_tokens_details)", c)
	}
	again := completion(t, e, map[string]any{"model": "pdq-sim", "prompt": prompt + " and more", "max_tokens": 4, "ignore_eos": true})
	full := first.Usage.PromptTokens / 16 * 16
	if c := cached(again.Usage); c != full {
		t.Errorf("the same prefix again: %d cached tokens, want its %d full-block tokens", c, full)
	}
	s := e.Stats(t)
	if s.PrefixHitTokens != int64(full) || s.PrefixQueryTokens != int64(first.Usage.PromptTokens+again.Usage.PromptTokens) {
		t.Errorf("prefix cache counted %d hits of %d queried tokens", s.PrefixHitTokens, s.PrefixQueryTokens)
	}
	m := call(t, http.MethodGet, e.URL+"/metrics", nil).want(t, http.StatusOK)
	for _, name := range []string{"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
		"vllm:num_preemptions_total", "vllm:num_requests_running", "vllm:num_requests_waiting"} {
		if !strings.Contains(string(m.body), name+"{") {
			t.Errorf("/metrics has no %s", name)
		}
	}
}

func TestBatchedPD(t *testing.T) {
	p := simtest.Start(t, batched(nil))
	d := simtest.Start(t, batched(nil))
	local := simtest.Start(t, batched(nil))
	prompt := words(300, 5)
	body := map[string]any{"model": "pdq-sim", "prompt": prompt, "max_tokens": 30}
	want := completion(t, local, body)

	pre := completion(t, p, map[string]any{"model": "pdq-sim", "prompt": prompt, "max_tokens": 1, "stream": false,
		"kv_transfer_params": prefillParams}, "X-Request-Id", "pd-1")
	if s := p.Stats(t); s.KVBlocksUsed == 0 {
		t.Fatalf("the prefill holds %d KV blocks for the decode, want its prompt's", s.KVBlocksUsed)
	}
	dec := completion(t, d, map[string]any{"model": "pdq-sim", "prompt": prompt, "max_tokens": 30,
		"kv_transfer_params": pre.KVTransferParams}, "X-Request-Id", "pd-1")
	if dec.Choices[0].Text != want.Choices[0].Text {
		t.Errorf("P/D said %q, a local run %q", dec.Choices[0].Text, want.Choices[0].Text)
	}
	if c := cached(dec.Usage); c != dec.Usage.PromptTokens {
		t.Errorf("decode: %d cached tokens of %d, want all read from the prefill", c, dec.Usage.PromptTokens)
	}
	ps := p.WaitStats(t, 5*time.Second, "prefill blocks freed", func(s sim.Stats) bool { return s.KVBlocksUsed == 0 })
	if ps.BlocksHeld != 0 {
		t.Errorf("%d blocks held after the read", ps.BlocksHeld)
	}
	if s := d.Stats(t); s.KVReads != 1 || s.KVBlocksUsed != 0 {
		t.Errorf("decode engine: %d reads, %d blocks in use; want 1 and 0", s.KVReads, s.KVBlocksUsed)
	}
}

// TestBatchedHeldBlocksFillTheCache: a prefill's blocks held for a decode
// that does not come count against the KV capacity, so the next request
// waits until the lease frees them.
func TestBatchedHeldBlocksFillTheCache(t *testing.T) {
	p := simtest.Start(t, batched(func(c *simconfig.Config) {
		c.NumGPUBlocks, c.KVLease, c.MaxModelLen = 30, 500*time.Millisecond, 400
	}))
	completion(t, p, map[string]any{"model": "pdq-sim", "prompt": words(300, 0), "max_tokens": 1,
		"kv_transfer_params": prefillParams})
	start := time.Now()
	completion(t, p, map[string]any{"model": "pdq-sim", "prompt": words(300, 1000), "max_tokens": 1})
	if s := p.Stats(t); s.HoldsExpired != 1 {
		t.Errorf("%d holds expired, want the first prefill's: the second request ran beside it", s.HoldsExpired)
	}
	t.Logf("the second request waited %v for the lease", time.Since(start).Round(time.Millisecond))
}

func TestBatchedPriority(t *testing.T) {
	fcfs := simtest.Start(t, batched(nil))
	call(t, http.MethodPost, fcfs.URL+"/v1/completions", map[string]any{"model": "pdq-sim", "prompt": "hi", "priority": 1}).
		apiError(t, http.StatusBadRequest, "Priority scheduling is not enabled")

	// One seat: a request runs while three wait; they are served lowest
	// priority value first. In real time (the seed's costs), each takes
	// 200 ms: far more than a client's noise in seeing its answer.
	e := simtest.Start(t, batched(func(c *simconfig.Config) { c.SchedulingPolicy = "priority"; c.MaxNumSeqs = 1; c.TimeScale = 1 }))
	post := func(body string) error {
		resp, err := http.Post(e.URL+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return err
		}
		return resp.Body.Close()
	}
	go post(`{"model":"pdq-sim","prompt":"first","max_tokens":50,"ignore_eos":true}`)
	e.WaitStats(t, 5*time.Second, "the first request running", func(s sim.Stats) bool { return s.Running == 1 })
	done := make(chan int, 3)
	for _, prio := range []int{5, -2, 0} {
		go func() {
			if err := post(fmt.Sprintf(`{"model":"pdq-sim","prompt":%q,"max_tokens":1,"priority":%d}`, words(2000, prio+10), prio)); err != nil {
				t.Error(err)
			}
			done <- prio
		}()
	}
	e.WaitStats(t, 5*time.Second, "three waiting", func(s sim.Stats) bool { return s.Waiting == 3 })
	var order []int
	for range 3 {
		order = append(order, <-done)
	}
	if order[0] != -2 || order[1] != 0 || order[2] != 5 {
		t.Errorf("served in priority order %v, want [-2 0 5]", order)
	}
}

func TestBatchedAbortFreesBlocks(t *testing.T) {
	e := simtest.Start(t, batched(nil))
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.URL+"/v1/completions",
		strings.NewReader(`{"model":"pdq-sim","prompt":"`+words(100, 0)+`","max_tokens":5000,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	e.WaitStats(t, 5*time.Second, "running with blocks", func(s sim.Stats) bool { return s.Running == 1 && s.KVBlocksUsed > 0 })
	cancel()
	resp.Body.Close()
	e.WaitStats(t, 5*time.Second, "blocks freed", func(s sim.Stats) bool { return s.Running == 0 && s.KVBlocksUsed == 0 })
}
