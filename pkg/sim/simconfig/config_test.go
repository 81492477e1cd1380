package simconfig

import (
	"flag"
	"slices"
	"testing"
	"time"
)

func TestBatchedFlags(t *testing.T) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"--profile", "seed", "--time-scale", "0.5", "--num-gpu-blocks-override", "1000",
		"--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--scheduling-policy", "priority",
		"--enable-prompt-tokens-details", "--max-num-seqs", "64"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	sc, perBlock, perRead := c.Sched()
	if sc.NumBlocks != 1000 || sc.MaxNumBatchedTokens != 2048 || sc.PrefixCaching || sc.Policy != "priority" || sc.MaxNumSeqs != 64 || sc.BlockSize != 16 {
		t.Errorf("scheduler config %+v", sc)
	}
	if sc.Cost.Base != 3*time.Millisecond || perBlock != 420*time.Microsecond || perRead != time.Millisecond {
		t.Errorf("costs at time scale 0.5: base %v, per block %v, per read %v; want the seed's halved", sc.Cost.Base, perBlock, perRead)
	}
	if !c.Batched() || !c.PromptTokensDetails {
		t.Errorf("config %+v", c)
	}
}

func TestFlags(t *testing.T) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	c.RegisterFlags(fs)
	err := fs.Parse([]string{
		"--model", "/models/llama",
		"--served-model-name", "llama, llama-8b", "--served-model-name", "default",
		"--lora-modules", "sql=/adapters/sql",
		"--lora-modules", `{"name":"chat","path":"/adapters/chat","base_model_name":"llama-8b"}`,
		"--allow-runtime-lora-updating=false", "--mm-tokens", "32", "--runner", "pooling",
		"--embedding-dim", "8", "--vllm-version", "0.9.2",
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.ServedModelNames, []string{"llama", "llama-8b", "default"}) {
		t.Errorf("served names = %q", c.ServedModelNames)
	}
	want := []LoRAModule{{Name: "sql", Path: "/adapters/sql"}, {Name: "chat", Path: "/adapters/chat", BaseModelName: "llama-8b"}}
	if !slices.Equal(c.LoRAModules, want) {
		t.Errorf("lora modules = %+v", c.LoRAModules)
	}
	if c.RuntimeLoRA || c.MMTokens != 32 || c.Runner != RunnerPooling || c.EmbeddingDim != 8 || c.Version != "0.9.2" {
		t.Errorf("config = %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
	for _, bad := range []string{`{"name":"x"}x`, `{"name":"x","path":"p","rank":8}`, `a,b`} {
		if m, err := ParseLoRAModule(bad); err == nil && m.Path != "" {
			t.Errorf("ParseLoRAModule(%q) = %+v", bad, m)
		}
	}
	for name, mutate := range map[string]func(*Config){
		"duplicate adapter": func(c *Config) { c.LoRAModules = []LoRAModule{{"a", "p", ""}, {"a", "q", ""}} },
		"adapter no path":   func(c *Config) { c.LoRAModules = []LoRAModule{{Name: "a"}} },
		"runner":            func(c *Config) { c.Runner = "draft" },
		"mm tokens":         func(c *Config) { c.MMTokens = 0 },
		"embedding dim":     func(c *Config) { c.EmbeddingDim = 0 },
		"empty served name": func(c *Config) { c.ServedModelNames = []string{" "} },
		"unknown profile":   func(c *Config) { c.Profile = "h100-70b" },
		"policy":            func(c *Config) { c.SchedulingPolicy = "lifo" },
		"time scale":        func(c *Config) { c.Profile, c.TimeScale = "seed", 0 },
		"budget":            func(c *Config) { c.Profile, c.MaxNumBatchedTokens = "seed", -1 },
		"max-model-len beyond the KV cache, as vLLM refuses it": func(c *Config) {
			c.Profile, c.NumGPUBlocks, c.MaxModelLen = "seed", 100, 1601
		},
	} {
		c := DefaultConfig()
		mutate(&c)
		if c.Validate() == nil {
			t.Errorf("%s: want a validation error", name)
		}
	}
}
