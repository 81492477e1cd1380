package sim

import (
	"flag"
	"slices"
	"strings"
	"testing"
)

func TestTokenIDs(t *testing.T) {
	for _, s := range []string{
		"", "   ", "hello", "hello world", "hello, world!", "abc123", "x...", "<|user|>\nHi\n<|assistant|>\n",
		"héllo wörld", "日本語 テキスト", " alpha bravo", "supercalifragilistic  expialidocious\t42",
		"tabs\tand\nnewlines\r\n", "trailing space  ", "\x00nul", "emoji 🙂🙂 ok", "  leading",
		strings.Repeat("long ", 50) + "end",
	} {
		ids := textIDs(s)
		rememberLongTokens(s) // as /tokenize does, for /detokenize
		if len(ids) != CountTokens(s) {
			t.Errorf("%q: %d ids, CountTokens %d", s, len(ids), CountTokens(s))
		}
		for _, id := range ids {
			if id < 0 || id >= 1<<53 {
				t.Errorf("%q: id %d is not JSON-safe", s, id)
			}
		}
		got, err := decodeIDs(ids)
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		if want := strings.TrimRightFunc(s, isSpaceRune); got != want {
			t.Errorf("decode(encode(%q)) = %q, want %q", s, got, want)
		}
	}
	// The model's words have small ids, and its output re-tokenizes to as
	// many tokens as it said.
	if id := tokenID(" thunder"); id < vocabBase || id >= vocabBase+2*len(vocabulary) {
		t.Errorf(`" thunder" = %d, not a vocabulary id`, id)
	}
	if got, _ := decodeIDs([]int{1, 2}); got != "<|reserved_1|><|reserved_2|>" {
		t.Errorf("reserved ids decode to %q", got)
	}
	for _, id := range []int{-1, vocabBase + 2*len(vocabulary), hashedBase + 12345, 1 << 60, packedBase + 1<<40, packedBase + 0x6120} {
		if _, err := decodeIDs([]int{id}); err == nil {
			t.Errorf("id %d: err = %v", id, err)
		}
	}
}

func isSpaceRune(r rune) bool { return charClass(r) == 0 }

func TestMediaIDs(t *testing.T) {
	ids := mediaIDs(modalityImage, 42, 4)
	if len(ids) != 4 {
		t.Fatalf("%d ids", len(ids))
	}
	text, err := decodeIDs(ids)
	if err != nil || text != "\n<image>" {
		t.Errorf("image ids decode to %q, %v", text, err)
	}
	if slices.Equal(ids, mediaIDs(modalityImage, 43, 4)) || slices.Equal(ids, mediaIDs(modalityAudio, 42, 4)) {
		t.Error("media ids do not depend on content and modality")
	}
	for _, id := range ids {
		if id >= 1<<53 {
			t.Errorf("id %d is not JSON-safe", id)
		}
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
	} {
		c := DefaultConfig()
		mutate(&c)
		if c.Validate() == nil {
			t.Errorf("%s: want a validation error", name)
		}
	}
}
