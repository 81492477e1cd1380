package tests

// What a client can send to a vLLM engine, it can send to pdq (issue 9):
// engines behind an API key, every model and adapter an engine serves,
// vLLM's own /v1/models fields, multimodal parts, batched prompts, the
// client's bytes on the wire, errors in the client's terms, and vLLM's
// other endpoints.

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/openai"
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
	for _, k := range []string{"id", "object", "owned_by", "root", "parent", "max_model_len", "created"} {
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
	})
	if s := p.decode[0].Stats(t); s.KVReads < 4 {
		t.Errorf("decode engine read %d KV handoffs: the long prompts of the batches must go P/D", s.KVReads)
	}
}
