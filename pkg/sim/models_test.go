package sim_test

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// card is a /v1/models entry as vLLM writes it; pointers tell null from
// absent.
type card struct {
	ID          string           `json:"id"`
	Object      string           `json:"object"`
	Created     int64            `json:"created"`
	OwnedBy     string           `json:"owned_by"`
	Root        *string          `json:"root"`
	Parent      *string          `json:"parent"`
	MaxModelLen *int             `json:"max_model_len"`
	Permission  []map[string]any `json:"permission"`
}

func listModels(t *testing.T, e *simtest.Engine) []card {
	t.Helper()
	r := call(t, http.MethodGet, e.URL+"/v1/models", nil).want(t, http.StatusOK)
	var raw struct {
		Object string            `json:"object"`
		Data   []json.RawMessage `json:"data"`
	}
	r.decode(t, &raw)
	if raw.Object != "list" {
		t.Errorf("object = %q", raw.Object)
	}
	cards := make([]card, len(raw.Data))
	for i, d := range raw.Data {
		// Every key is present, null or not, as pydantic's model_dump
		// writes them.
		var keys map[string]json.RawMessage
		json.Unmarshal(d, &keys)
		for _, k := range []string{"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"} {
			if _, ok := keys[k]; !ok {
				t.Errorf("card %s lacks %q", d, k)
			}
		}
		if err := json.Unmarshal(d, &cards[i]); err != nil {
			t.Fatal(err)
		}
	}
	return cards
}

func TestServedModelNames(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) {
		c.Model = "/models/llama-3.1-8b"
		c.ServedModelNames = []string{"llama", "llama-8b"}
	}))
	cards := listModels(t, e)
	if len(cards) != 2 || cards[0].ID != "llama" || cards[1].ID != "llama-8b" {
		t.Fatalf("cards = %+v", cards)
	}
	for _, c := range cards {
		if c.Object != "model" || c.OwnedBy != "vllm" || c.Created == 0 || c.Root == nil || *c.Root != "/models/llama-3.1-8b" ||
			c.Parent != nil || c.MaxModelLen == nil || *c.MaxModelLen != 8192 {
			t.Errorf("card = %+v", c)
		}
		if len(c.Permission) != 1 {
			t.Fatalf("permission = %+v", c.Permission)
		}
		p := c.Permission[0]
		want := map[string]any{"object": "model_permission", "allow_create_engine": false, "allow_sampling": true,
			"allow_logprobs": true, "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
			"organization": "*", "group": nil, "is_blocking": false}
		for k, v := range want {
			if !reflect.DeepEqual(p[k], v) {
				t.Errorf("permission[%s] = %v, want %v", k, p[k], v)
			}
		}
		if id, _ := p["id"].(string); !strings.HasPrefix(id, "modelperm-") {
			t.Errorf("permission id = %v", p["id"])
		}
	}

	// Every served name is accepted; the response carries the first.
	var texts []string
	for _, name := range []string{"llama", "llama-8b"} {
		c := completion(t, e, map[string]any{"model": name, "prompt": "hi", "max_tokens": 3, "ignore_eos": true})
		if c.Model != "llama" {
			t.Errorf("model %s answered as %q, want the first served name", name, c.Model)
		}
		texts = append(texts, c.Choices[0].Text)
		ch := chat(t, e, map[string]any{"model": name, "messages": user("hi"), "max_tokens": 1})
		if ch.Model != "llama" {
			t.Errorf("chat: model %s answered as %q", name, ch.Model)
		}
	}
	if texts[0] != texts[1] {
		t.Errorf("two names of one model said %q and %q", texts[0], texts[1])
	}
	// No model (absent, null, ""): the first served name, as in vLLM.
	for _, model := range []any{nil, ""} {
		c := completion(t, e, map[string]any{"model": model, "prompt": "hi", "max_tokens": 3, "ignore_eos": true})
		if c.Model != "llama" || c.Choices[0].Text != texts[0] {
			t.Errorf("model %v answered as %q, %q; want llama's %q", model, c.Model, c.Choices[0].Text, texts[0])
		}
	}
	if ch := chat(t, e, map[string]any{"messages": user("hi"), "max_tokens": 1}); ch.Model != "llama" {
		t.Errorf("chat without a model answered as %q, want llama", ch.Model)
	}
	// --model is not a name once served names are set, as in vLLM.
	call(t, http.MethodPost, e.URL+"/v1/completions", map[string]any{"model": "/models/llama-3.1-8b", "prompt": "hi"}).
		apiError(t, http.StatusNotFound, "The model `/models/llama-3.1-8b` does not exist.")
	// Metrics are labelled with the first served name.
	if m := call(t, http.MethodGet, e.URL+"/metrics", nil); !strings.Contains(string(m.body), `model_name="llama"`) {
		t.Error("metrics are not labelled with the first served name")
	}
}

func TestLoRAAdapters(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) {
		c.ServedModelNames = []string{"base", "base-alias"}
		c.LoRAModules = []simconfig.LoRAModule{{Name: "sql", Path: "/adapters/sql"}, {Name: "chat", Path: "/adapters/chat", BaseModelName: "base-alias"}}
	}))
	cards := listModels(t, e)
	if len(cards) != 4 {
		t.Fatalf("cards = %+v", cards)
	}
	for i, want := range []struct{ id, root, parent string }{{"sql", "/adapters/sql", "base"}, {"chat", "/adapters/chat", "base-alias"}} {
		c := cards[2+i]
		if c.ID != want.id || c.Root == nil || *c.Root != want.root || c.Parent == nil || *c.Parent != want.parent ||
			c.MaxModelLen != nil || len(c.Permission) != 1 || c.OwnedBy != "vllm" {
			t.Errorf("adapter card = %+v, want %+v", c, want)
		}
	}

	body := func(model string) map[string]any {
		return map[string]any{"model": model, "prompt": "Tell me a story", "max_tokens": 8, "ignore_eos": true}
	}
	base := completion(t, e, body("base"))
	sql := completion(t, e, body("sql"))
	chatAdapter := completion(t, e, body("chat"))
	if sql.Model != "sql" || chatAdapter.Model != "chat" || base.Model != "base" {
		t.Errorf("models = %q %q %q", base.Model, sql.Model, chatAdapter.Model)
	}
	if sql.Choices[0].Text == base.Choices[0].Text || sql.Choices[0].Text == chatAdapter.Choices[0].Text {
		t.Errorf("adapters and base said the same: %q %q %q", base.Choices[0].Text, sql.Choices[0].Text, chatAdapter.Choices[0].Text)
	}
	if again := completion(t, e, body("sql")); again.Choices[0].Text != sql.Choices[0].Text {
		t.Error("an adapter is not deterministic")
	}
	if sql.Usage.PromptTokens != base.Usage.PromptTokens {
		t.Errorf("an adapter counts the prompt as %d tokens, the base as %d", sql.Usage.PromptTokens, base.Usage.PromptTokens)
	}

	t.Run("runtime load and unload", func(t *testing.T) {
		load := func(b any) reply { return call(t, http.MethodPost, e.URL+"/v1/load_lora_adapter", b) }
		unload := func(b any) reply { return call(t, http.MethodPost, e.URL+"/v1/unload_lora_adapter", b) }
		call(t, http.MethodPost, e.URL+"/v1/completions", body("new")).apiError(t, http.StatusNotFound, "The model `new` does not exist.")
		r := load(map[string]any{"lora_name": "new", "lora_path": "/adapters/new"}).want(t, http.StatusOK)
		if string(r.body) != "Success: LoRA adapter 'new' added successfully." {
			t.Errorf("load said %q", r.body)
		}
		if got := completion(t, e, body("new")); got.Model != "new" || got.Choices[0].Text == base.Choices[0].Text {
			t.Errorf("loaded adapter answered %+v", got)
		}
		if cards := listModels(t, e); cards[len(cards)-1].ID != "new" || *cards[len(cards)-1].Root != "/adapters/new" {
			t.Errorf("cards = %+v", cards)
		}
		e1 := load(map[string]any{"lora_name": "new", "lora_path": "/adapters/new2"}).apiError(t, http.StatusBadRequest,
			"The lora adapter 'new' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.")
		if e1.Type != "InvalidUserInput" {
			t.Errorf("type = %q", e1.Type)
		}
		load(map[string]any{"lora_name": "new", "lora_path": "/adapters/new2", "load_inplace": true}).want(t, http.StatusOK)
		load(map[string]any{"lora_name": "x"}).apiError(t, http.StatusBadRequest, "Both 'lora_name' and 'lora_path' must be provided.")
		r = unload(map[string]any{"lora_name": "new"}).want(t, http.StatusOK)
		if string(r.body) != "Success: LoRA adapter 'new' removed successfully." {
			t.Errorf("unload said %q", r.body)
		}
		unload(map[string]any{"lora_name": "new"}).apiError(t, http.StatusNotFound, "The lora adapter 'new' cannot be found.")
		unload(map[string]any{}).apiError(t, http.StatusBadRequest, "'lora_name' needs to be provided to unload a LoRA adapter.")
		call(t, http.MethodPost, e.URL+"/v1/completions", body("new")).apiError(t, http.StatusNotFound, "does not exist")
	})

	t.Run("runtime updates off", func(t *testing.T) {
		off := simtest.Start(t, fast(func(c *simconfig.Config) { c.RuntimeLoRA = false }))
		call(t, http.MethodPost, off.URL+"/v1/load_lora_adapter", map[string]any{"lora_name": "a", "lora_path": "/a"}).want(t, http.StatusNotFound)
	})
}

// The P/D handshake checks the adapter: KV prefilled under one adapter is
// another cache than the base model's.
func TestLoRAPrefillDecode(t *testing.T) {
	cfg := fast(func(c *simconfig.Config) {
		c.LoRAModules = []simconfig.LoRAModule{{Name: "sql", Path: "/adapters/sql"}}
	})
	p, d, plain := simtest.Start(t, cfg), simtest.Start(t, cfg), simtest.Start(t, cfg)
	b := map[string]any{"model": "sql", "messages": user("SELECT the answer"), "max_tokens": 12, "ignore_eos": true}
	want := chat(t, plain, b).Choices[0].Message.Content

	run := func(id string, decodeModel string) string {
		pb := map[string]any{"model": "sql", "messages": b["messages"], "max_tokens": 1, "kv_transfer_params": prefillParams}
		pr := chat(t, p, pb, "X-Request-Id", id)
		if pr.Model != "sql" || len(pr.KVTransferParams) == 0 || string(pr.KVTransferParams) == "null" {
			t.Fatalf("prefill = %+v", pr)
		}
		var params any
		json.Unmarshal(pr.KVTransferParams, &params)
		db := map[string]any{"model": decodeModel, "messages": b["messages"], "max_tokens": 12, "ignore_eos": true, "kv_transfer_params": params}
		return chat(t, d, db, "X-Request-Id", id).Choices[0].Message.Content
	}
	if got := run("lora-1", "sql"); got != want {
		t.Errorf("P/D under the adapter said %q, a plain engine %q", got, want)
	}
	if s := d.Stats(t); s.KVReads != 1 || s.KVMismatches != 0 {
		t.Errorf("decode stats = %+v", s)
	}
	// The decode leg asks for the base model with the adapter's blocks.
	run("lora-2", "pdq-sim")
	if s := d.Stats(t); s.KVMismatches != 1 {
		t.Errorf("a decode of the base model on the adapter's KV was not caught: %+v", s)
	}
}
