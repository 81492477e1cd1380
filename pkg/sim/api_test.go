package sim_test

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

type tokenized struct {
	Count       int       `json:"count"`
	MaxModelLen int       `json:"max_model_len"`
	Tokens      []int     `json:"tokens"`
	TokenStrs   *[]string `json:"token_strs"`
}

func TestTokenize(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) { c.MaxModelLen = 4096 }))
	tokenize := func(b any) tokenized {
		var out tokenized
		call(t, http.MethodPost, e.URL+"/tokenize", b).want(t, http.StatusOK).decode(t, &out)
		return out
	}
	detok := func(ids []int) string {
		var out struct {
			Prompt string `json:"prompt"`
		}
		call(t, http.MethodPost, e.URL+"/detokenize", map[string]any{"model": "pdq-sim", "tokens": ids}).want(t, http.StatusOK).decode(t, &out)
		return out.Prompt
	}

	prompt := "Hello, world! Count 42 things: supercalifragilistic ones."
	tk := tokenize(map[string]any{"model": "pdq-sim", "prompt": prompt})
	if tk.Count != len(tk.Tokens) || tk.Count != tokenizer.CountTokens(prompt) || tk.MaxModelLen != 4096 || tk.TokenStrs != nil {
		t.Errorf("tokenize = %+v", tk)
	}
	raw := call(t, http.MethodPost, e.URL+"/tokenize", map[string]any{"prompt": prompt}).want(t, http.StatusOK).body
	if !bytes.HasPrefix(raw, []byte(`{"count":`)) || !bytes.HasSuffix(raw, []byte(`,"token_strs":null}`)) {
		t.Errorf("body = %s; want vLLM's key order and a null token_strs", raw)
	}
	if got := detok(tk.Tokens); got != prompt {
		t.Errorf("detokenize(tokenize(x)) = %q, want %q", got, prompt)
	}
	// The count is the usage of the same prompt, and token ids are the same
	// prompt to the model as its text.
	c := completion(t, e, map[string]any{"model": "pdq-sim", "prompt": prompt, "max_tokens": 5, "ignore_eos": true})
	byIDs := completion(t, e, map[string]any{"model": "pdq-sim", "prompt": tk.Tokens, "max_tokens": 5, "ignore_eos": true})
	if c.Usage.PromptTokens != tk.Count || byIDs.Usage.PromptTokens != tk.Count {
		t.Errorf("usage %d / %d, tokenize count %d", c.Usage.PromptTokens, byIDs.Usage.PromptTokens, tk.Count)
	}
	// The text prompt ends mid-word, so its answer starts with a space;
	// the token-id prompt is read without that hint.
	if strings.TrimSpace(c.Choices[0].Text) != strings.TrimSpace(byIDs.Choices[0].Text) {
		t.Errorf("text prompt said %q, its token ids %q", c.Choices[0].Text, byIDs.Choices[0].Text)
	}
	// Generated text re-tokenizes to completion_tokens.
	if n := tokenize(map[string]any{"prompt": c.Choices[0].Text}).Count; n != c.Usage.CompletionTokens {
		t.Errorf("the answer re-tokenizes to %d tokens, usage says %d", n, c.Usage.CompletionTokens)
	}

	// Chat: the count is the chat request's prompt_tokens, media included.
	msgs := user([]any{image("https://x/cat.png"), text("What is this?")})
	ct := tokenize(map[string]any{"model": "pdq-sim", "messages": msgs, "return_token_strs": true})
	cc := chat(t, e, map[string]any{"model": "pdq-sim", "messages": msgs, "max_tokens": 1})
	if ct.Count != cc.Usage.PromptTokens || ct.TokenStrs == nil || len(*ct.TokenStrs) != ct.Count {
		t.Errorf("chat tokenize = %+v, usage %+v", ct, cc.Usage)
	}
	if got := detok(ct.Tokens); got != "<|user|>\n<image>\nWhat is this?\n<|assistant|>" {
		t.Errorf("chat detokenizes to %q", got)
	}
	noGen := tokenize(map[string]any{"messages": msgs, "add_generation_prompt": false})
	if noGen.Count != ct.Count-tokenizer.CountTokens("<|assistant|>") {
		t.Errorf("without the generation prompt: %d tokens, with: %d", noGen.Count, ct.Count)
	}

	call(t, http.MethodPost, e.URL+"/tokenize", map[string]any{"model": "nope", "prompt": "x"}).apiError(t, http.StatusNotFound, "The model `nope` does not exist.")
	call(t, http.MethodPost, e.URL+"/tokenize", map[string]any{"model": "pdq-sim"}).apiError(t, http.StatusBadRequest, "required")
	call(t, http.MethodPost, e.URL+"/tokenize", map[string]any{"messages": []any{map[string]any{"content": "x"}}}).apiError(t, http.StatusBadRequest, "role is required")
	call(t, http.MethodPost, e.URL+"/detokenize", map[string]any{"tokens": []int{1<<20 + 1<<40}}).apiError(t, http.StatusBadRequest, "out of vocabulary")
	call(t, http.MethodPost, e.URL+"/detokenize", map[string]any{"tokens": []int{-1}}).apiError(t, http.StatusBadRequest, "negative")
}

func TestVersionAndAPIKey(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) { c.APIKey = "k"; c.Version = "0.11.2" }))
	var v struct {
		Version string `json:"version"`
	}
	call(t, http.MethodGet, e.URL+"/version", nil).want(t, http.StatusOK).decode(t, &v)
	if v.Version != "0.11.2" {
		t.Errorf("version = %q", v.Version)
	}
	// vLLM's --api-key guards /v1 only.
	call(t, http.MethodPost, e.URL+"/tokenize", map[string]any{"prompt": "x"}).want(t, http.StatusOK)
	call(t, http.MethodPost, e.URL+"/detokenize", map[string]any{"tokens": []int{1}}).want(t, http.StatusOK)
	for _, path := range []string{"/v1/models", "/v1/load_lora_adapter", "/v1/embeddings"} {
		method := http.MethodPost
		if path == "/v1/models" {
			method = http.MethodGet
		}
		if r := call(t, method, e.URL+path, map[string]any{}); r.status != http.StatusUnauthorized || string(r.body) != `{"error":"Unauthorized"}` {
			t.Errorf("%s without the key: %d %s", path, r.status, r.body)
		}
	}
	call(t, http.MethodGet, e.URL+"/v1/models", nil, "Authorization", "Bearer k").want(t, http.StatusOK)
}

type embedResponse struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Data    []struct {
		Index     int             `json:"index"`
		Object    string          `json:"object"`
		Embedding json.RawMessage `json:"embedding"`
	} `json:"data"`
	Usage map[string]any `json:"usage"`
}

func TestEmbeddings(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) { c.Runner = simconfig.RunnerPooling; c.EmbeddingDim = 32 }))
	embed := func(b any, headers ...string) embedResponse {
		var out embedResponse
		call(t, http.MethodPost, e.URL+"/v1/embeddings", b, headers...).want(t, http.StatusOK).decode(t, &out)
		return out
	}
	vec := func(raw json.RawMessage) []float64 {
		var v []float64
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	r := embed(map[string]any{"model": "pdq-sim", "input": []string{"first text", "second text", "first text"}}, "X-Request-Id", "emb-1")
	if r.ID != "embd-emb-1" || r.Object != "list" || r.Model != "pdq-sim" || len(r.Data) != 3 || r.Created == 0 {
		t.Fatalf("response = %+v", r)
	}
	want := map[string]any{"prompt_tokens": float64(6), "total_tokens": float64(6), "completion_tokens": float64(0), "prompt_tokens_details": nil}
	for k, v := range want {
		if got, ok := r.Usage[k]; !ok || got != v {
			t.Errorf("usage[%s] = %v, want %v", k, got, v)
		}
	}
	vs := make([][]float64, 3)
	for i, d := range r.Data {
		if d.Index != i || d.Object != "embedding" {
			t.Errorf("data[%d] = %+v", i, d)
		}
		vs[i] = vec(d.Embedding)
		var norm float64
		for _, x := range vs[i] {
			norm += x * x
		}
		if len(vs[i]) != 32 || math.Abs(norm-1) > 1e-5 {
			t.Errorf("vector %d: length %d, norm² %v", i, len(vs[i]), norm)
		}
	}
	if vs[0][0] != vs[2][0] || vs[0][0] == vs[1][0] {
		t.Error("vectors are not a function of the input")
	}

	b64 := embed(map[string]any{"model": "pdq-sim", "input": "first text", "encoding_format": "base64"})
	var s string
	json.Unmarshal(b64.Data[0].Embedding, &s)
	buf, err := base64.StdEncoding.DecodeString(s)
	if err != nil || len(buf) != 4*32 {
		t.Fatalf("base64 embedding: %d bytes, %v", len(buf), err)
	}
	for k := range 32 {
		if got := float64(math.Float32frombits(binary.LittleEndian.Uint32(buf[4*k:]))); got != vs[0][k] {
			t.Fatalf("base64 value %d = %v, float %v", k, got, vs[0][k])
		}
	}
	if d := embed(map[string]any{"input": [][]int{{1, 2, 3}}, "dimensions": 8}); len(vec(d.Data[0].Embedding)) != 8 {
		t.Error("dimensions not applied")
	}
	call(t, http.MethodPost, e.URL+"/v1/embeddings", map[string]any{"model": "x", "input": "a"}).apiError(t, http.StatusNotFound, "does not exist")
	call(t, http.MethodPost, e.URL+"/v1/embeddings", map[string]any{"model": "pdq-sim"}).apiError(t, http.StatusBadRequest, "'input' is required")
	// A pooling model serves no generation.
	if r := call(t, http.MethodPost, e.URL+"/v1/completions", map[string]any{"model": "pdq-sim", "prompt": "a"}); r.status != http.StatusNotFound || string(r.body) != `{"detail":"Not Found"}` {
		t.Errorf("completions on a pooling model: %d %s", r.status, r.body)
	}

	// A generative model has no /v1/embeddings route, as in vLLM.
	g := simtest.Start(t, fast(nil))
	if r := call(t, http.MethodPost, g.URL+"/v1/embeddings", map[string]any{"model": "pdq-sim", "input": "a"}); r.status != http.StatusNotFound || string(r.body) != `{"detail":"Not Found"}` {
		t.Errorf("embeddings on a generative model: %d %s", r.status, r.body)
	}
}
