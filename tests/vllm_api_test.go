package tests

// What a client can send to a vLLM engine, it can send to pdq (issue 9):
// engines behind an API key, every model and adapter an engine serves,
// vLLM's own /v1/models fields, multimodal parts, batched prompts, the
// client's bytes on the wire, errors in the client's terms, and vLLM's
// other endpoints.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/jsonobj"
	"github.com/pdq-dev/pdq/pkg/sim"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/workers"
)

// TestEngineAPIKey runs pdq in front of engines started with --api-key:
// every engine call carries the key (PDQ_ENGINE_API_KEY), so the workers
// find the model and both legs run.
func TestEngineAPIKey(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.APIKey = "engine-secret"
	p := startPipeline(t, pipelineOptions{sim: cfg, worker: workers.Config{EngineAPIKey: "engine-secret"}})

	r := post(t, p.chat(), "keyed-1", chatBody(cfg.Model, longPrompt, body{"max_tokens": 4}))
	r.wantStatus(t, http.StatusOK)
	if s := p.decode[0].Stats(t); s.Decodes != 1 || s.KVReads != 1 {
		t.Errorf("decode engine stats %+v: want one P/D decode that read the prefill's KV", s)
	}
	var models struct {
		Data []struct{ ID string } `json:"data"`
	}
	get(t, p.url+"/v1/models").decode(t, &models)
	if len(models.Data) != 1 || models.Data[0].ID != cfg.Model {
		t.Errorf("/v1/models = %+v, want %s", models.Data, cfg.Model)
	}
	// Every call the engines got carried the key: both legs, /v1/models.
	for _, e := range append(p.prefill, p.decode...) {
		paths := map[string]bool{}
		for _, r := range e.RecentRequests(t) {
			paths[r.Path] = true
			if !r.HasAuth {
				t.Errorf("%s %s reached %s without the key", r.Method, r.Path, e.URL)
			}
		}
		if !paths["/v1/models"] || !paths[openai.Chat.Path()] {
			t.Errorf("engine %s got %v, want /v1/models and the chat leg", e.URL, paths)
		}
	}
}

// TestEngineRefusesTheKey: workers whose key the engines refuse serve
// nothing (api.md): the model is not listed, and a request for it is a
// 404, not an engine's 401 passed on.
func TestEngineRefusesTheKey(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.APIKey = "engine-secret"
	p := startPipeline(t, pipelineOptions{sim: cfg, prefill: -1, decode: -1, worker: workers.Config{EngineAPIKey: "wrong"}})
	prefill, decode := simtest.Start(t, cfg), simtest.Start(t, cfg)
	p.startWorker(dispatcher.StagePrefill, prefill.URL, 1)
	p.startWorker(dispatcher.StageDecode, decode.URL, 1)
	// The workers asked, were refused, and asked again: the first refusal
	// has been taken in before the checks below.
	for _, e := range []*simtest.Engine{prefill, decode} {
		waitUntil(t, "engine "+e.URL+" asked twice for its models", func() bool { return asked(t, e, "/v1/models") >= 2 })
	}
	var models struct {
		Data []struct{ ID string } `json:"data"`
	}
	get(t, p.url+"/v1/models").decode(t, &models)
	if len(models.Data) != 0 {
		t.Errorf("/v1/models = %+v, want none: no engine took the key", models.Data)
	}
	post(t, p.chat(), "refused-key-1", chatBody(cfg.Model, longPrompt, body{"max_tokens": 4})).wantStatus(t, http.StatusNotFound)
	if s := decode.Stats(t); s.Decodes != 0 {
		t.Errorf("decode engine stats %+v: want no decode", s)
	}
}

// asked counts the engine's recent requests for path.
func asked(t *testing.T, e *simtest.Engine, path string) int {
	t.Helper()
	n := 0
	for _, r := range e.RecentRequests(t) {
		if r.Path == path {
			n++
		}
	}
	return n
}

// TestModelsCarryEngineFields checks that /v1/models lists each model as
// its engine does, max_model_len and owned_by included.
func TestModelsCarryEngineFields(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxModelLen = 4096
	p := startPipeline(t, pipelineOptions{sim: cfg})
	var ours, engine struct {
		Object string           `json:"object"`
		Data   []map[string]any `json:"data"`
	}
	get(t, p.url+"/v1/models").decode(t, &ours)
	get(t, p.decode[0].URL+"/v1/models").decode(t, &engine)
	if ours.Object != "list" || len(ours.Data) != 1 {
		t.Fatalf("/v1/models = %+v", ours)
	}
	got, want := ours.Data[0], engine.Data[0]
	for _, k := range []string{"id", "object", "owned_by", "root", "parent", "max_model_len"} { // created is the time of the call, at vLLM
		if g, w := jsonOf(got[k]), jsonOf(want[k]); g != w {
			t.Errorf("/v1/models %s = %s, the engine says %s", k, g, w)
		}
	}
	if got["max_model_len"] != float64(4096) {
		t.Errorf("max_model_len = %v, want 4096", got["max_model_len"])
	}
}

func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestLengthRefusedBeforePrefill sends max_tokens beyond the decode
// engines' context length: the gateway refuses it with vLLM's message and
// the client's own number, and no engine sees it. Before, a prefill ran and
// held its KV until the decode engine's 400.
func TestLengthRefusedBeforePrefill(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxModelLen = 2048
	p := startPipeline(t, pipelineOptions{sim: cfg})
	pbefore, dbefore := p.prefill[0].Stats(t), p.decode[0].Stats(t)
	for _, tc := range []struct {
		name, url string
		b         body
		want      string
	}{
		{"chat max_tokens", p.chat(), chatBody(cfg.Model, longPrompt, body{"max_tokens": 1000000000}), "too large: 1000000000"},
		{"chat max_completion_tokens", p.chat(), chatBody(cfg.Model, longPrompt, body{"max_completion_tokens": 2048}), "too large: 2048"},
		{"token prompt", p.completions(), body{"model": cfg.Model, "prompt": make([]int, 2000), "max_tokens": 100},
			"too large: 100. This model's maximum context length is 2048 tokens and your request has 2000 input tokens (100 > 2048 - 2000)"},
		{"token prompt too long", p.completions(), body{"model": cfg.Model, "prompt": make([]int, 2048)}, "your request has 2048 input tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := post(t, tc.url, "", tc.b)
			r.wantStatus(t, http.StatusBadRequest)
			if e := r.apiError(t); !strings.Contains(e.Message, tc.want) || !strings.Contains(e.Message, "maximum context length is 2048") {
				t.Errorf("error %q, want it to say %q", e.Message, tc.want)
			}
			if bytes.Contains(r.body, []byte(`\u003e`)) {
				t.Errorf("body %s escapes '>', which vLLM writes as it is", r.body)
			}
		})
	}
	if pa, da := p.prefill[0].Stats(t), p.decode[0].Stats(t); pa.Requests != pbefore.Requests || da.Requests != dbefore.Requests {
		t.Errorf("engines saw %d prefill and %d decode requests for requests refused at the gateway",
			pa.Requests-pbefore.Requests, da.Requests-dbefore.Requests)
	}
	// Within the limit, the same request runs.
	r := post(t, p.chat(), "", chatBody(cfg.Model, longPrompt, body{"max_tokens": 8}))
	r.wantStatus(t, http.StatusOK)
}

// TestMultimodalParts sends chat messages with image, audio and video
// parts through both legs: they reach each engine as the client sent
// them, and the answer is the engine's own for that request.
func TestMultimodalParts(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	content := []any{
		map[string]any{"type": "text", "text": longPrompt},
		map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64,iVBORw0KGgo="}},
		map[string]any{"type": "input_audio", "input_audio": map[string]any{"data": "UklGRg==", "format": "wav"}},
		map[string]any{"type": "video_url", "video_url": map[string]any{"url": "https://example.com/v.mp4"}},
	}
	b := body{"model": cfg.Model, "messages": []any{map[string]any{"role": "user", "content": content}}, "max_tokens": 6}
	r := post(t, p.chat(), "mm-1", b)
	r.wantStatus(t, http.StatusOK)
	got, _ := parseResponse(t, r)
	if s := p.decode[0].Stats(t); s.KVReads != 1 {
		t.Errorf("decode engine read %d KV handoffs, want 1: the request must go P/D", s.KVReads)
	}
	// The engine alone, asked the same, answers the same text.
	direct := post(t, p.decode[0].URL+openai.Chat.Path(), "mm-direct", b)
	direct.wantStatus(t, http.StatusOK)
	want, _ := parseResponse(t, direct)
	if got.text != want.text || got.usage != want.usage {
		t.Errorf("through pdq: %q %+v; the engine alone: %q %+v", got.text, got.usage, want.text, want.usage)
	}
}

// batchAnswer is what a client makes of a completions answer to a batch,
// streamed or not: the text and finish reason of each choice by index.
type batchAnswer struct {
	ids    map[string]bool
	object string
	texts  map[int]string
	finish map[int]string
	usage  []openai.Usage // one per usage-bearing message
}

func newBatchAnswer() *batchAnswer {
	return &batchAnswer{ids: map[string]bool{}, texts: map[int]string{}, finish: map[int]string{}}
}

func (a *batchAnswer) add(t *testing.T, data []byte) {
	t.Helper()
	var c chunk
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatalf("answer %s: %v", data, err)
	}
	if c.Error != nil {
		t.Fatalf("error in the answer: %+v", c.Error)
	}
	a.ids[c.ID], a.object = true, c.Object
	for _, ch := range c.Choices {
		if ch.Text != nil {
			a.texts[ch.Index] += *ch.Text
		}
		if ch.FinishReason != nil {
			a.finish[ch.Index] = *ch.FinishReason
		}
	}
	if c.Usage != nil {
		a.usage = append(a.usage, *c.Usage)
	}
}

// TestBatchedPrompts sends completions with several prompts, streamed and
// not: pdq answers with vLLM's shape for a batch (one id, one choice per
// prompt in order, usage summed), and the texts are the engine's own for
// the same batch.
func TestBatchedPrompts(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	prompts := []any{longPrompt + " One.", "Short one.", longPrompt + " Three."}
	b := body{"model": cfg.Model, "prompt": prompts, "max_tokens": 5, "ignore_eos": true}
	direct := func(t *testing.T, b body, id string) *batchAnswer {
		a := newBatchAnswer()
		if b["stream"] == true {
			s := postStream(t, p.decode[0].URL+openai.Completions.Path(), id, b)
			for _, ev := range s.events {
				a.add(t, ev)
			}
			return a
		}
		r := post(t, p.decode[0].URL+openai.Completions.Path(), id, b)
		r.wantStatus(t, http.StatusOK)
		a.add(t, r.body)
		return a
	}
	check := func(t *testing.T, got, want *batchAnswer, id string) {
		t.Helper()
		if len(got.ids) != 1 || !got.ids["cmpl-"+id] {
			t.Errorf("ids %v, want only cmpl-%s", got.ids, id)
		}
		if got.object != "text_completion" {
			t.Errorf("object %q", got.object)
		}
		if len(got.texts) != len(prompts) {
			t.Errorf("%d choices, want %d", len(got.texts), len(prompts))
		}
		for i := range prompts {
			if got.texts[i] != want.texts[i] || got.finish[i] != want.finish[i] {
				t.Errorf("choice %d: %q (%s); the engine alone: %q (%s)", i, got.texts[i], got.finish[i], want.texts[i], want.finish[i])
			}
		}
		if len(got.usage) != 1 || len(want.usage) != 1 || got.usage[0] != want.usage[0] {
			t.Errorf("usage %+v; the engine alone: %+v", got.usage, want.usage)
		}
	}

	t.Run("whole", func(t *testing.T) {
		r := post(t, p.completions(), "batch-1", b)
		r.wantStatus(t, http.StatusOK)
		got := newBatchAnswer()
		got.add(t, r.body)
		check(t, got, direct(t, b, "batch-direct-1"), "batch-1")
	})
	t.Run("streamed", func(t *testing.T) {
		sb := b.clone()
		sb["stream"], sb["stream_options"] = true, map[string]any{"include_usage": true}
		s := postStream(t, p.completions(), "batch-2", sb)
		if s.status != http.StatusOK || !s.done || s.err != nil {
			t.Fatalf("stream: status %d, done %v, err %v: %s", s.status, s.done, s.err, s.events)
		}
		got := newBatchAnswer()
		for i, ev := range s.events {
			got.add(t, ev)
			if len(got.usage) > 0 && i != len(s.events)-1 {
				t.Errorf("usage before the last event")
			}
		}
		check(t, got, direct(t, sb, "batch-direct-2"), "batch-2")
	})
	t.Run("one refused", func(t *testing.T) {
		// A prompt the engine refuses fails the whole request, as at vLLM.
		bad := b.clone()
		bad["prompt"] = []any{"fine", strings.Repeat("word ", 9000)}
		r := post(t, p.completions(), "batch-3", bad)
		r.wantStatus(t, http.StatusBadRequest)
		// Nothing was answered: the client may retry under the same id.
		post(t, p.completions(), "batch-3", b).wantStatus(t, http.StatusOK)
	})
	t.Run("copies over the size limit", func(t *testing.T) {
		// 256 prompts, each sent with 30 KB of other fields: 7.5 MB of
		// copies, over the gateway's 7 MiB body limit.
		many := make([]any, 256)
		for i := range many {
			many[i] = "p"
		}
		big := b.clone()
		big["prompt"], big["user"] = many, strings.Repeat("u", 30<<10)
		before := p.prefill[0].Stats(t).Requests + p.decode[0].Stats(t).Requests
		post(t, p.completions(), "", big).wantStatus(t, http.StatusRequestEntityTooLarge)
		if after := p.prefill[0].Stats(t).Requests + p.decode[0].Stats(t).Requests; after != before {
			t.Errorf("%d engine requests for a refused batch", after-before)
		}
	})
	if s := p.decode[0].Stats(t); s.KVReads < 4 {
		t.Errorf("decode engine read %d KV handoffs: the long prompts of the batches must go P/D", s.KVReads)
	}
}

// TestEveryServedModel runs engines with two served names and a LoRA
// adapter: pdq serves each, with the engine's own answer for that model,
// lists each with its engine's card, and takes in an adapter loaded at run
// time (and lets go of one unloaded) within the workers' refresh.
func TestEveryServedModel(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.Model = "/models/base"
	cfg.ServedModelNames = []string{"base-a", "base-b"}
	cfg.LoRAModules = []simconfig.LoRAModule{{Name: "sql-lora", Path: "/adapters/sql"}}
	p := startPipeline(t, pipelineOptions{sim: cfg, worker: workers.Config{ModelsRefresh: 100 * time.Millisecond}})

	answer := func(t *testing.T, url, model, id string) (string, string) {
		t.Helper()
		r := post(t, url+openai.Chat.Path(), id, chatBody(model, longPrompt, body{"max_tokens": 6, "ignore_eos": true}))
		r.wantStatus(t, http.StatusOK)
		var c struct {
			Model string `json:"model"`
		}
		r.decode(t, &c)
		got, _ := parseResponse(t, r)
		return c.Model, got.text
	}
	texts := map[string]string{}
	for _, model := range []string{"base-a", "base-b", "sql-lora"} {
		gotModel, text := answer(t, p.url, model, "served-"+model)
		wantModel, want := answer(t, p.decode[0].URL, model, "served-direct-"+model)
		if gotModel != wantModel || text != want {
			t.Errorf("%s through pdq: model %q, %q; the engine alone: %q, %q", model, gotModel, text, wantModel, want)
		}
		texts[model] = text
	}
	if texts["sql-lora"] == texts["base-a"] {
		t.Errorf("the adapter answered as the base model: %q", texts["sql-lora"])
	}
	if s := p.decode[0].Stats(t); s.KVReads != 3 {
		t.Errorf("decode engine read %d KV handoffs, want 3: every model goes P/D", s.KVReads)
	}

	cards := func() map[string]map[string]any {
		var list struct {
			Data []map[string]any `json:"data"`
		}
		get(t, p.url+"/v1/models").decode(t, &list)
		out := map[string]map[string]any{}
		for _, c := range list.Data {
			out[c["id"].(string)] = c
		}
		return out
	}
	got := cards()
	if len(got) != 3 {
		t.Fatalf("/v1/models lists %v, want base-a, base-b and sql-lora", got)
	}
	if c := got["sql-lora"]; c["root"] != "/adapters/sql" || c["parent"] != "base-a" {
		t.Errorf("adapter card %v: want root /adapters/sql, parent base-a", c)
	}
	if c := got["base-b"]; c["root"] != "/models/base" || c["parent"] != nil || c["max_model_len"] != float64(cfg.MaxModelLen) {
		t.Errorf("base card %v", c)
	}

	// An adapter loaded at run time joins its pool; unloaded, it leaves.
	lora := func(path string, b body) {
		for _, e := range append(p.prefill, p.decode...) {
			post(t, e.URL+path, "", b).wantStatus(t, http.StatusOK)
		}
	}
	waitModel := func(model string, listed bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, ok := cards()[model]; ok == listed {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("/v1/models: %s listed is not %v after 10 s", model, listed)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	lora("/v1/load_lora_adapter", body{"lora_name": "new-lora", "lora_path": "/adapters/new"})
	waitModel("new-lora", true)
	// The prefill worker may join a moment after the decode worker.
	deadline := time.Now().Add(10 * time.Second)
	for p.prefillWorkers("new-lora") == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	gotModel, text := answer(t, p.url, "new-lora", "served-new-lora")
	if _, want := answer(t, p.decode[0].URL, "new-lora", "served-direct-new-lora"); gotModel != "new-lora" || text != want {
		t.Errorf("new-lora through pdq: %q %q; the engine alone: %q", gotModel, text, want)
	}
	lora("/v1/unload_lora_adapter", body{"lora_name": "new-lora"})
	waitModel("new-lora", false)
	r := post(t, p.chat(), "", chatBody("new-lora", longPrompt, nil))
	if r.status != http.StatusServiceUnavailable && r.status != http.StatusNotFound {
		t.Errorf("a request for an unloaded adapter: status %d, want 503 or 404", r.status)
	}
}

// TestClientBytesReachTheEngines checks that each leg's body is the
// client's bytes with only the P/D fields changed: key order, spacing and
// unescaped <, > and & stay as the client wrote them.
func TestClientBytesReachTheEngines(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	prompt := strings.ReplaceAll(longPrompt, "a prefill", "a <prefill> & \"decode\"") + " é\u2028"
	for _, tc := range []struct {
		name, url, client, prefill, decode string
	}{
		{
			name:    "chat",
			url:     p.chat(),
			client:  `{"temperature": 0.5,  "model":"` + cfg.Model + `", "messages":[{"role":"user","content":` + rawString(prompt) + `}], "stream":true, "stream_options":{"include_usage":true}, "max_tokens":5, "min_tokens":2}`,
			prefill: `{"temperature": 0.5,  "model":"` + cfg.Model + `", "messages":[{"role":"user","content":` + rawString(prompt) + `}], "stream":false, "max_tokens":1,"kv_transfer_params":` + prefillSkeleton + `}`,
			decode:  `{"temperature": 0.5,  "model":"` + cfg.Model + `", "messages":[{"role":"user","content":` + rawString(prompt) + `}], "stream":true, "stream_options":{"include_usage":true}, "max_tokens":5, "min_tokens":2,"kv_transfer_params":@KV@}`,
		},
		{
			name:    "completions with max_completion_tokens",
			url:     p.completions(),
			client:  "{\n  \"prompt\": " + rawString(prompt) + ",\n  \"model\": \"" + cfg.Model + "\",\n  \"max_completion_tokens\": 4\n}",
			prefill: "{\n  \"prompt\": " + rawString(prompt) + ",\n  \"model\": \"" + cfg.Model + "\",\n  \"max_completion_tokens\": 1,\"kv_transfer_params\":" + prefillSkeleton + ",\"stream\":false,\"max_tokens\":1\n}",
			decode:  "{\n  \"prompt\": " + rawString(prompt) + ",\n  \"model\": \"" + cfg.Model + "\",\n  \"max_completion_tokens\": 4,\"kv_transfer_params\":@KV@\n}",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "bytes-" + strings.ReplaceAll(tc.name, " ", "-")
			resp, err := sendRaw(tc.url, id, []byte(tc.client))
			if err != nil || resp.status != http.StatusOK {
				t.Fatalf("status %d, %v: %s", resp.status, err, resp.body)
			}
			pre := p.prefill[0].Requests(t, id)
			dec := p.decode[0].Requests(t, id)
			if len(pre) != 1 || len(dec) != 1 {
				t.Fatalf("engines got %d prefill and %d decode requests for %s, want 1 and 1", len(pre), len(dec), id)
			}
			if got := string(pre[0].Body); got != tc.prefill {
				t.Errorf("prefill leg:\n got %s\nwant %s", got, tc.prefill)
			}
			kv, _, _ := jsonobj.Get(dec[0].Body, "kv_transfer_params")
			if want := strings.Replace(tc.decode, "@KV@", string(kv), 1); string(dec[0].Body) != want || len(kv) == 0 {
				t.Errorf("decode leg:\n got %s\nwant %s", dec[0].Body, want)
			}
		})
	}
}

// prefillSkeleton is the prefill leg's kv_transfer_params, as vLLM's
// reference proxy sends them.
const prefillSkeleton = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// rawString is s as a JSON string, with <, > and & left as they are.
func rawString(s string) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.Encode(s)
	return strings.TrimSpace(b.String())
}

// sendRaw posts body's exact bytes.
func sendRaw(url, id string, b []byte) (response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return response{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	return response{status: resp.StatusCode, header: resp.Header, body: raw}, err
}

// TestErrorsInClientTerms runs engines that word length errors as vLLM
// before 0.10 did ("P in the messages, M in the completion"): a prompt
// over the context length is refused with the client's max_tokens, not the
// prefill leg's 1; and a request only the prefill engine refuses (its
// context is shorter) is served by the decode engine.
func TestErrorsInClientTerms(t *testing.T) {
	t.Run("refused by both", func(t *testing.T) {
		cfg := simtest.FastConfig()
		cfg.MaxModelLen, cfg.LegacyLengthErrors = 64, true
		p := startPipeline(t, pipelineOptions{sim: cfg})
		r := post(t, p.chat(), "", chatBody(cfg.Model, strings.Repeat(longPrompt+" ", 4), body{"max_tokens": 50}))
		r.wantStatus(t, http.StatusBadRequest)
		e := r.apiError(t)
		if !strings.Contains(e.Message, "50 in the completion") || strings.Contains(e.Message, " 1 in the completion") {
			t.Errorf("error %q: want the client's 50 in the completion", e.Message)
		}
	})
	t.Run("refused by prefill only", func(t *testing.T) {
		cfg := simtest.FastConfig()
		pcfg := cfg
		pcfg.MaxModelLen = 32
		p := startPipeline(t, pipelineOptions{sim: cfg, prefillSim: &pcfg})
		r := post(t, p.chat(), "", chatBody(cfg.Model, strings.Repeat(longPrompt+" ", 4), body{"max_tokens": 5}))
		r.wantStatus(t, http.StatusOK)
		if s := p.decode[0].Stats(t); s.Local != 1 {
			t.Errorf("decode engine stats %+v: want the request prefilled there", s)
		}
	})
}

// TestEngineCalls forwards vLLM's other endpoints to a decode engine of
// the model, with the engine key, and returns the engine's answers and
// errors as they came.
func TestEngineCalls(t *testing.T) {
	gen := simtest.FastConfig()
	gen.APIKey = "engine-secret"
	p := startPipeline(t, pipelineOptions{sim: gen, worker: workers.Config{EngineAPIKey: "engine-secret"}})
	for _, tc := range []struct {
		name, method, path string
		b                  any
	}{
		{"tokenize", http.MethodPost, "/tokenize", body{"model": gen.Model, "prompt": longPrompt}},
		{"tokenize chat", http.MethodPost, "/tokenize", body{"model": gen.Model, "messages": []any{map[string]any{"role": "user", "content": "hi"}}}},
		{"detokenize", http.MethodPost, "/detokenize", body{"model": gen.Model, "tokens": []int{}}},
		{"version", http.MethodGet, "/version", nil},
		{"embeddings on a generative model", http.MethodPost, "/v1/embeddings", body{"model": gen.Model, "input": "x"}},
		{"tokenize without model", http.MethodPost, "/tokenize", body{"prompt": "hello there"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := do(t, tc.method, p.url+tc.path, nil, tc.b)
			h := http.Header{"Authorization": {"Bearer engine-secret"}}
			want := do(t, tc.method, p.decode[0].URL+tc.path, h, tc.b)
			if got.status != want.status || !bytes.Equal(got.body, want.body) {
				t.Errorf("through pdq: %d %s\nthe engine: %d %s", got.status, got.body, want.status, want.body)
			}
		})
	}
	t.Run("unknown model", func(t *testing.T) {
		r := post(t, p.url+"/tokenize", "", body{"model": "gpt-9", "prompt": "x"})
		r.wantStatus(t, http.StatusNotFound)
	})
	t.Run("embeddings", func(t *testing.T) {
		embed := simtest.FastConfig()
		embed.Model, embed.APIKey, embed.Runner = "embedder", "engine-secret", simconfig.RunnerPooling
		e := simtest.Start(t, embed)
		p.startWorker(dispatcher.StageDecode, e.URL, 0)
		b := body{"model": "embedder", "input": []string{"a", "b"}}
		deadline := time.Now().Add(10 * time.Second)
		r := post(t, p.url+"/v1/embeddings", "", b)
		for r.status == http.StatusNotFound && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
			r = post(t, p.url+"/v1/embeddings", "", b)
		}
		r.wantStatus(t, http.StatusOK)
		want := do(t, http.MethodPost, e.URL+"/v1/embeddings", http.Header{"Authorization": {"Bearer engine-secret"}}, b)
		var got, direct struct {
			Data  json.RawMessage `json:"data"`
			Usage json.RawMessage `json:"usage"`
			Model string          `json:"model"`
		}
		r.decode(t, &got)
		want.decode(t, &direct)
		if string(got.Data) != string(direct.Data) || string(got.Usage) != string(direct.Usage) || got.Model != "embedder" {
			t.Errorf("through pdq: %s\nthe engine: %s", r.body, want.body)
		}
	})
}

// prefillWorkers counts the registered prefill workers of model.
func (p *pipeline) prefillWorkers(model string) int {
	kv, err := p.js.KeyValue(p.ctx, dispatcher.BucketWorkers)
	if err != nil {
		return 0
	}
	keys, _ := kv.Keys(p.ctx)
	n := 0
	for _, k := range keys {
		e, err := kv.Get(p.ctx, k)
		if err != nil {
			continue
		}
		var w dispatcher.WorkerInfo
		if json.Unmarshal(e.Value(), &w) == nil && w.Role == dispatcher.StagePrefill && w.Model == model {
			n++
		}
	}
	return n
}

// TestBatchClientGone checks that a client who leaves a batched stream
// stops every prompt's work, streamed or not.
func TestBatchClientGone(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.ITL = 5 * time.Millisecond
	p := startPipeline(t, pipelineOptions{sim: cfg})
	prompts := []any{longPrompt + " One.", longPrompt + " Two.", "Three."}
	for i, stream := range []bool{true, false} {
		ctx, cancel := context.WithCancel(context.Background())
		b := body{"model": cfg.Model, "prompt": prompts, "max_tokens": 5000, "ignore_eos": true, "stream": stream}
		if stream {
			resp, err := send(ctx, p.completions(), "", b)
			if err != nil {
				t.Fatal(err)
			}
			r := openai.NewSSEReader(resp.Body)
			for range 6 {
				if _, err := r.Next(); err != nil {
					t.Fatal(err)
				}
			}
			cancel()
			resp.Body.Close()
		} else {
			done := make(chan struct{})
			go func() {
				defer close(done)
				if resp, err := send(ctx, p.completions(), "", b); err == nil {
					resp.Body.Close()
				}
			}()
			// Gone while all three decode.
			p.decode[0].WaitStats(t, 10*time.Second, "three decoding", func(s sim.Stats) bool { return s.Running == 3 })
			cancel()
			<-done
		}
		want := int64(3 * (i + 1))
		p.decode[0].WaitStats(t, 10*time.Second, "every prompt aborted", func(s sim.Stats) bool { return s.Aborts == want && s.Running == 0 })
	}
}

// TestEngineSlotsSharedByModels runs an engine that serves two names on
// one decode slot: a handoff for the second name, pulled while the first
// fills the engine, waits for the slot and is checked after the wait, so
// a handoff older than the KV lease is prefilled again instead of read
// from freed blocks. (Found by review: the wait came after the check.)
func TestEngineSlotsSharedByModels(t *testing.T) {
	for _, second := range []string{"a", "b"} {
		t.Run("second request for "+second, func(t *testing.T) {
			cfg := simtest.FastConfig()
			cfg.Model = "/models/base"
			cfg.ServedModelNames = []string{"a", "b"}
			cfg.KVLease = 500 * time.Millisecond
			cfg.ITL = 20 * time.Millisecond
			p := startPipeline(t, pipelineOptions{sim: cfg, slots: 1,
				worker: workers.Config{KVTTL: 400 * time.Millisecond}})
			var wg sync.WaitGroup
			wg.Go(func() { // holds the decode engine's one slot for about 2 s
				post(t, p.chat(), "long-a", chatBody("a", longPrompt, body{"max_tokens": 100, "ignore_eos": true})).wantStatus(t, http.StatusOK)
			})
			p.decode[0].WaitStats(t, 10*time.Second, "the long decode running", func(s sim.Stats) bool { return s.Running == 1 })
			r := post(t, p.chat(), "second-"+second, chatBody(second, longPrompt, body{"max_tokens": 3, "ignore_eos": true}))
			wg.Wait()
			r.wantStatus(t, http.StatusOK)
			if s := p.decode[0].Stats(t); s.KVReadFailures > 0 || s.KVMismatches > 0 {
				t.Errorf("decode engine stats %+v: want no failed or mismatched KV read", s)
			}
		})
	}
}

// The tests below hold pdq to vLLM's own behaviour where pdq differed
// without a reason (issue 25), as read in vLLM's source:
// vllm/entrypoints/openai/engine/serving.py (_base_request_id,
// _is_model_supported), completion/serving.py (the response id),
// models/serving.py and ModelCard (created at the call), and
// serve/instrumentator/health.py.

// TestVLLMRequestWithoutModel: vLLM serves a request without a model (or
// with null or "") with its served model. So does pdq when it serves one
// model, and the engines get the client's bytes with that model filled
// in. With several models it is a 400 that names them.
func TestVLLMRequestWithoutModel(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	messages := `"messages":[{"role":"user","content":` + rawString(longPrompt) + `}]`
	for _, tc := range []struct {
		name, url, client, sent string
	}{
		{"chat without model", p.chat(), `{` + messages + `, "max_tokens": 3}`,
			`{` + messages + `, "max_tokens": 3,"model":"` + cfg.Model + `"}`},
		{"chat with model null", p.chat(), `{"model": null, ` + messages + `, "max_tokens": 3}`,
			`{"model": "` + cfg.Model + `", ` + messages + `, "max_tokens": 3}`},
		{"completions with model empty", p.completions(), `{"prompt": ` + rawString(longPrompt) + `, "model": "", "max_tokens": 3}`,
			`{"prompt": ` + rawString(longPrompt) + `, "model": "` + cfg.Model + `", "max_tokens": 3}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "nomodel-" + strings.ReplaceAll(tc.name, " ", "-")
			r, err := sendRaw(tc.url, id, []byte(tc.client))
			if err != nil || r.status != http.StatusOK {
				t.Fatalf("status %d, %v: %s", r.status, err, r.body)
			}
			var got struct {
				Model string `json:"model"`
			}
			r.decode(t, &got)
			// The engine alone answers so too, with its served model.
			direct, err := sendRaw(strings.Replace(tc.url, p.url, p.decode[0].URL, 1), id+"-direct", []byte(tc.client))
			if err != nil || direct.status != http.StatusOK {
				t.Fatalf("the engine alone: status %d, %v: %s", direct.status, err, direct.body)
			}
			var want struct {
				Model string `json:"model"`
			}
			direct.decode(t, &want)
			if got.Model != cfg.Model || want.Model != cfg.Model {
				t.Errorf("model %q through pdq, %q at the engine; want %q", got.Model, want.Model, cfg.Model)
			}
			dec := p.decode[0].Requests(t, id)
			if len(dec) != 1 {
				t.Fatalf("the decode engine got %d requests for %s, want 1", len(dec), id)
			}
			sent, err := jsonobj.Edit(dec[0].Body, jsonobj.Delete("kv_transfer_params"))
			if err != nil || string(sent) != tc.sent {
				t.Errorf("decode leg without its kv_transfer_params:\n got %s\nwant %s", sent, tc.sent)
			}
		})
	}

	t.Run("several models", func(t *testing.T) {
		cfg := simtest.FastConfig()
		cfg.Model = "/models/base"
		cfg.ServedModelNames = []string{"base-a", "base-b"}
		p := startPipeline(t, pipelineOptions{sim: cfg})
		// /tokenize too: vLLM's other endpoints go to an engine of the
		// request's model.
		for _, url := range []string{p.chat(), p.completions(), p.url + "/tokenize"} {
			r := post(t, url, "", body{"messages": []any{map[string]any{"role": "user", "content": "x"}}, "prompt": "x"})
			r.wantStatus(t, http.StatusBadRequest)
			e := r.apiError(t)
			if e.Param == nil || *e.Param != "model" || !strings.Contains(e.Message, "`base-a`, `base-b`") {
				t.Errorf("%s: error %+v; want param model and both models named", url, e)
			}
		}
		if s := p.decode[0].Stats(t); s.Requests != 0 {
			t.Errorf("a request without a model reached an engine: %+v", s)
		}
	})
}

// TestVLLMAnyRequestID: vLLM takes any X-Request-Id as its request id.
// pdq takes any printable id up to 256 bytes: one that is not a subject
// token runs under a key made from it, while the client sees its own id
// echoed, in the response ids and in its record, and a repeat of it is
// still a 409.
func TestVLLMAnyRequestID(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	long := strings.Repeat("0123456789abcdef", 16) // 256 bytes, a subject token but too long for one
	for _, id := range []string{"req.1:abc", "a b", "pdq.reply.>", "x/y?z=%41#", long} {
		t.Run(id[:min(len(id), 16)], func(t *testing.T) {
			r := post(t, p.chat(), id, chatBody(cfg.Model, longPrompt, body{"max_tokens": 3}))
			res, _ := parseResponse(t, r)
			if got := r.header.Get("X-Request-Id"); got != id {
				t.Errorf("X-Request-Id echoed as %q", got)
			}
			if res.id != "chatcmpl-"+id {
				t.Errorf("response id %q, want chatcmpl-%s as at vLLM", res.id, id)
			}
			// Both legs carried one id, a subject token.
			last := func(e *simtest.Engine) string {
				rs := e.RecentRequests(t)
				for i := len(rs) - 1; i >= 0; i-- {
					if rs[i].Path == openai.Chat.Path() {
						return rs[i].ID
					}
				}
				return ""
			}
			pre, dec := last(p.prefill[0]), last(p.decode[0])
			if pre != dec || !dispatcher.ValidRequestID(dec) {
				t.Errorf("the legs carried X-Request-Id %q and %q; want one subject-safe id", pre, dec)
			}
			again := post(t, p.chat(), id, chatBody(cfg.Model, longPrompt, body{"max_tokens": 3}))
			again.wantStatus(t, http.StatusConflict)
			if got := again.header.Get("X-Request-Id"); got != id {
				t.Errorf("the 409 echoes X-Request-Id %q", got)
			}
			var rec struct {
				ID       string `json:"id"`
				ClientID string `json:"client_id"`
				State    string `json:"state"`
			}
			got := get(t, p.url+"/v1/requests/"+url.PathEscape(id))
			got.wantStatus(t, http.StatusOK)
			got.decode(t, &rec)
			if rec.State != "done" || rec.ID != dec || rec.ClientID != id {
				t.Errorf("record %s; want done, under the engines' id %q, with client_id %q", got.body, dec, id)
			}
			// The key, as records show it, finds the record too.
			if byKey := get(t, p.url+"/v1/requests/"+dec); byKey.status != http.StatusOK || !bytes.Equal(byKey.body, got.body) {
				t.Errorf("GET by the key %s: %d %s", dec, byKey.status, byKey.body)
			}
		})
	}
	t.Run("a subject token stays as it is", func(t *testing.T) {
		r := post(t, p.chat(), "plain-id_1", chatBody(cfg.Model, "hi", body{"max_tokens": 2}))
		r.wantStatus(t, http.StatusOK)
		if ids := p.decode[0].Requests(t, "plain-id_1"); len(ids) != 1 {
			t.Errorf("the engine got %d requests under the client's own id, want 1", len(ids))
		}
		var rec map[string]any
		get(t, p.url+"/v1/requests/plain-id_1").decode(t, &rec)
		if rec["id"] != "plain-id_1" || rec["client_id"] != nil {
			t.Errorf("record %v; want id plain-id_1 and no client_id", rec)
		}
	})
	for _, tc := range []struct{ name, id string }{
		{"a control character", "a\tb"},
		{"not ASCII", "caf\u00e9"},
		{"over 256 bytes", long + "x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := post(t, p.chat(), tc.id, chatBody(cfg.Model, "hi", body{"max_tokens": 2}))
			r.wantStatus(t, http.StatusBadRequest)
			if e := r.apiError(t); !strings.Contains(e.Message, "X-Request-Id") {
				t.Errorf("error %+v", e)
			}
		})
	}
	if s := p.decode[0].Stats(t); s.EngineDead || s.KVReadFailures != 0 {
		t.Errorf("decode engine stats %+v", s)
	}
}

// TestVLLMCompletionIDs: vLLM answers a completions request with the id
// cmpl-<X-Request-Id>, one prompt or a batch, whole or streamed.
func TestVLLMCompletionIDs(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	for _, id := range []string{"cmpl-ids-1", "cmpl ids.2"} {
		for _, prompt := range []any{longPrompt, []any{longPrompt, "Short one."}} {
			for _, streamed := range []bool{false, true} {
				_, batch := prompt.([]any)
				name := fmt.Sprintf("%s batch %v streamed %v", id, batch, streamed)
				t.Run(name, func(t *testing.T) {
					rid := fmt.Sprintf("%s %v %v", id, batch, streamed)
					if !strings.Contains(id, " ") {
						rid = fmt.Sprintf("%s-%v-%v", id, batch, streamed)
					}
					b := completionBody(cfg.Model, "", body{"prompt": prompt, "max_tokens": 3, "stream": streamed})
					a := newBatchAnswer()
					if streamed {
						s := postStream(t, p.completions(), rid, b)
						if s.status != http.StatusOK || !s.done {
							t.Fatalf("stream: %d %v %s", s.status, s.err, s.events)
						}
						for _, ev := range s.events {
							a.add(t, ev)
						}
					} else {
						r := post(t, p.completions(), rid, b)
						r.wantStatus(t, http.StatusOK)
						a.add(t, r.body)
					}
					if len(a.ids) != 1 || !a.ids["cmpl-"+rid] {
						t.Errorf("ids %v, want only cmpl-%s", a.ids, rid)
					}
				})
			}
		}
	}
}

// TestVLLMHealthAndModels: the gateway's /health answers as vLLM's does
// (200, an empty body, no Content-Type), and /v1/models' created is the
// time of the call, as vLLM builds its cards for each call.
func TestVLLMHealthAndModels(t *testing.T) {
	cfg := simtest.FastConfig()
	p := startPipeline(t, pipelineOptions{sim: cfg})
	ours, engine := get(t, p.url+"/health"), get(t, p.decode[0].URL+"/health")
	for _, r := range []response{ours, engine} {
		if r.status != http.StatusOK || len(r.body) != 0 || r.header.Get("Content-Type") != "" || r.header.Get("Content-Length") != "0" {
			t.Errorf("/health: %d %v %q; want 200, an empty body, no Content-Type", r.status, r.header, r.body)
		}
	}
	// The workers registered their cards a second ago or more.
	time.Sleep(1100 * time.Millisecond)
	before := time.Now().Unix()
	var list struct {
		Data []struct {
			ID         string `json:"id"`
			Created    int64  `json:"created"`
			Permission []struct {
				Created int64 `json:"created"`
			} `json:"permission"`
		} `json:"data"`
	}
	get(t, p.url+"/v1/models").decode(t, &list)
	after := time.Now().Unix()
	if len(list.Data) != 1 {
		t.Fatalf("/v1/models lists %+v", list.Data)
	}
	m := list.Data[0]
	if m.Created < before || m.Created > after {
		t.Errorf("created %d, want the time of the call (%d to %d)", m.Created, before, after)
	}
	for _, perm := range m.Permission {
		if perm.Created < before || perm.Created > after {
			t.Errorf("permission created %d, want the time of the call (%d to %d)", perm.Created, before, after)
		}
	}
}
