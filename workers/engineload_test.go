package workers

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// TestSlotPolicy runs the policy through looks at an engine's load, each
// with the slots used then, and checks the slots and seats after each.
func TestSlotPolicy(t *testing.T) {
	type look struct {
		load               vllm.Load
		used, slots, seats int // used before the look; slots and seats after
	}
	for _, tc := range []struct {
		name  string
		most  int
		first int
		looks []look
	}{
		{"full twice: what it runs and one more", 64, 64, []look{
			{vllm.Load{Running: 2, Waiting: 30}, 32, 64, 1},
			{vllm.Load{Running: 2, Waiting: 30}, 32, 3, 2},
		}},
		{"full once: a moment's queue changes nothing", 64, 16, []look{
			{vllm.Load{Running: 4, Waiting: 12}, 16, 16, 1},
			{vllm.Load{Running: 16}, 16, 32, 16},
		}},
		{"full and large: an eighth more", 512, 512, []look{
			{vllm.Load{Running: 256, Waiting: 90}, 346, 512, 1},
			{vllm.Load{Running: 256, Waiting: 90}, 346, 288, 256},
		}},
		{"full: never more than now", 64, 8, []look{
			{vllm.Load{Running: 40, Waiting: 10}, 8, 8, 1},
			{vllm.Load{Running: 40, Waiting: 10}, 8, 8, 8},
		}},
		{"decodes waiting for their KV: not full, the slots stay", 64, 16, []look{
			{vllm.Load{Running: 14, Waiting: 1}, 16, 16, 14},
			{vllm.Load{Running: 13, Waiting: 1}, 16, 16, 14},
			{vllm.Load{Running: 15, Waiting: 1}, 16, 16, 15},
		}},
		{"more waiting for KV than an eighth: no walk down", 64, 8, []look{
			{vllm.Load{Running: 6, Waiting: 2}, 8, 8, 1},
			{vllm.Load{Running: 6, Waiting: 2}, 8, 7, 6},
			{vllm.Load{Running: 5, Waiting: 2}, 7, 7, 6},
			{vllm.Load{Running: 5, Waiting: 2}, 7, 7, 6},
		}},
		{"slots given on trial are not seats", 64, 3, []look{
			{vllm.Load{Running: 2, Waiting: 4}, 6, 3, 1},
			{vllm.Load{Running: 2, Waiting: 4}, 6, 3, 2},
			{vllm.Load{Running: 2}, 3, 6, 2},
			{vllm.Load{Running: 2, Waiting: 4}, 6, 6, 2},
			{vllm.Load{Running: 2, Waiting: 4}, 6, 3, 2},
		}},
		{"keeping up with every slot taken: twice", 64, 4, []look{
			{vllm.Load{Running: 4}, 4, 8, 4},
			{vllm.Load{Running: 8}, 8, 16, 8},
		}},
		{"keeping up: no more than PDQ_ENGINE_SLOTS", 64, 40, []look{{vllm.Load{Running: 40}, 40, 64, 40}}},
		{"keeping up with slots to spare: as is", 64, 16, []look{{vllm.Load{Running: 3}, 3, 16, 3}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p slotPolicy
			slots := tc.first
			for i, l := range tc.looks {
				next, seats := p.next(l.load, l.used, slots, tc.most)
				if next != l.slots || seats != l.seats {
					t.Fatalf("look %d at %+v with %d of %d slots used: %d slots, %d seats; want %d and %d",
						i+1, l.load, l.used, slots, next, seats, l.slots, l.seats)
				}
				slots = next
			}
		})
	}
}

// TestFollowLoad: against a pdq sim engine that runs 2 requests at once,
// a worker's slots start at firstSlots, drop to what the engine runs (and
// one more) once it makes requests wait, tell the gate the 2 it runs, and
// double again once it keeps up. An engine without vLLM's /metrics gets
// PDQ_ENGINE_SLOTS.
func TestFollowLoad(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxNumSeqs, cfg.ITL = 2, 20*time.Millisecond
	engine := simtest.Start(t, cfg)
	w, err := New(nil, nil, withSettings(Config{Role: dispatcher.StageDecode, EngineURL: engine.URL, Slots: 64}), logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	f := loadFollower{w: w}
	f.look(ctx)
	if _, slots, _ := w.slots.Load(); slots != firstSlots || w.slots.Seats() != 1 {
		t.Fatalf("after a look at an idle engine: %d slots, %d seats; want %d and 1 (none seen yet)", slots, w.slots.Seats(), firstSlots)
	}

	// 4 jobs in the engine, which runs 2 of them.
	var calls sync.WaitGroup
	for i := range firstSlots {
		if !w.slots.TryAcquire() {
			t.Fatal("a free slot refused")
		}
		calls.Go(func() {
			body := fmt.Sprintf(`{"model":%q,"prompt":"hello there","max_tokens":40,"ignore_eos":true}`, cfg.Model)
			resp, err := w.engine.Post(ctx, openai.Completions, fmt.Sprintf("load-%d", i), []byte(body))
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}
	engine.WaitStats(t, 5*time.Second, "2 running, 2 waiting", func(s sim.Stats) bool { return s.Running == 2 && s.Waiting == 2 })
	f.look(ctx) // full once: it may be a moment's queue
	if _, slots, _ := w.slots.Load(); slots != firstSlots {
		t.Errorf("an engine seen full once: %d slots, want %d", slots, firstSlots)
	}
	f.look(ctx)
	if _, slots, _ := w.slots.Load(); slots != 3 || w.slots.Seats() != 2 {
		t.Errorf("an engine running 2 and queueing 2: %d slots, %d seats; want 3 and 2", slots, w.slots.Seats())
	}
	calls.Wait()
	f.look(ctx) // every slot still taken, nothing waits: twice as many
	if _, slots, _ := w.slots.Load(); slots != 6 {
		t.Errorf("an engine keeping up, every slot taken: %d slots, want 6", slots)
	}

	none := httptest.NewServer(http.NotFoundHandler())
	defer none.Close()
	w2, err := New(nil, nil, withSettings(Config{Role: dispatcher.StagePrefill, EngineURL: none.URL, Slots: 16}), logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	f2 := loadFollower{w: w2}
	if wait := f2.look(ctx); wait != loadRetry {
		t.Errorf("an engine without /metrics is asked again in %v, want %v", wait, loadRetry)
	}
	if _, slots, _ := w2.slots.Load(); slots != 16 || !f2.told {
		t.Errorf("an engine without /metrics: %d slots (told %v), want PDQ_ENGINE_SLOTS (16), said once", slots, f2.told)
	}
}

// withSettings is cfg with every setting config gives a worker, where the
// test left it unset: New fills in none.
func withSettings(cfg Config) Config {
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{
		{&cfg.Grace, config.DefaultShutdownGrace}, {&cfg.RetryBase, config.RetryBase}, {&cfg.AckWait, config.DefaultAckWait},
		{&cfg.KVTTL, config.DefaultKVTTL}, {&cfg.PrefillTimeout, config.DefaultPrefillTimeout},
		{&cfg.StallTimeout, config.DefaultStallTimeout}, {&cfg.ModelsRefresh, config.ModelsRefresh},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct {
		v   *int
		def int
	}{
		{&cfg.MaxGenerations, config.DefaultMaxGenerations}, {&cfg.MaxDeliver, config.DefaultMaxDeliver},
		{&cfg.BreakerFailures, config.DefaultBreakerFailures}, {&cfg.Slots, config.DefaultDecodeSlots},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	return cfg
}

// TestNewTakesEverySetting: New fills in no default (they are config's):
// a setting left at zero is an error, not a value.
func TestNewTakesEverySetting(t *testing.T) {
	base := withSettings(Config{Role: dispatcher.StageDecode, EngineURL: "http://127.0.0.1:1"})
	if _, err := New(nil, nil, base, logging.Discard()); err != nil {
		t.Fatalf("every setting given: %v", err)
	}
	for name, unset := range map[string]func(*Config){
		"slots":            func(c *Config) { c.Slots = 0 },
		"grace":            func(c *Config) { c.Grace = 0 },
		"retry base":       func(c *Config) { c.RetryBase = 0 },
		"ack wait":         func(c *Config) { c.AckWait = 0 },
		"KV TTL":           func(c *Config) { c.KVTTL = 0 },
		"max generations":  func(c *Config) { c.MaxGenerations = 0 },
		"max deliveries":   func(c *Config) { c.MaxDeliver = 0 },
		"prefill time-out": func(c *Config) { c.PrefillTimeout = 0 },
		"stall time-out":   func(c *Config) { c.StallTimeout = 0 },
		"breaker failures": func(c *Config) { c.BreakerFailures = 0 },
		"models refresh":   func(c *Config) { c.ModelsRefresh = 0 },
	} {
		cfg := base
		unset(&cfg)
		if _, err := New(nil, nil, cfg, logging.Discard()); err == nil {
			t.Errorf("no %s: New took it", name)
		}
	}
}
