package sim_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

func image(url string) map[string]any {
	return map[string]any{"type": "image_url", "image_url": map[string]any{"url": url}}
}

func text(s string) map[string]any { return map[string]any{"type": "text", "text": s} }

func TestMultimodalParts(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) { c.MMTokens = 20 }))
	ask := func(parts ...any) openai.ChatCompletion {
		return chat(t, e, map[string]any{"model": "pdq-sim", "messages": user(parts), "max_tokens": 10, "ignore_eos": true})
	}
	textOnly := ask(text("What is this?"))
	cat := ask(image("https://x/cat.png"), text("What is this?"))
	// The image is 20 tokens; its placeholder line adds only the newline
	// after it, which is whitespace.
	if got, want := cat.Usage.PromptTokens, textOnly.Usage.PromptTokens+20; got != want {
		t.Errorf("prompt_tokens with an image = %d, want %d", got, want)
	}
	dog := ask(image("https://x/dog.png"), text("What is this?"))
	if cat.Choices[0].Message.Content == dog.Choices[0].Message.Content || cat.Choices[0].Message.Content == textOnly.Choices[0].Message.Content {
		t.Error("the image does not change the answer")
	}
	if again := ask(map[string]any{"type": "image_url", "image_url": map[string]any{"url": "https://x/cat.png", "detail": "auto"}}, text("What is this?")); again.Choices[0].Message.Content != cat.Choices[0].Message.Content {
		t.Error("the same image gave another answer")
	}
	all := ask(image("a"), map[string]any{"type": "input_audio", "input_audio": map[string]any{"data": "AAAA", "format": "wav"}},
		map[string]any{"type": "video_url", "video_url": map[string]any{"url": "v"}},
		map[string]any{"type": "audio_url", "audio_url": map[string]any{"url": "s"}}, text("Describe."))
	only := ask(text("Describe."))
	if all.Usage.PromptTokens != only.Usage.PromptTokens+4*20 {
		t.Errorf("four media parts count %d tokens over the text, want 80", all.Usage.PromptTokens-only.Usage.PromptTokens)
	}

	// The template: placeholders first, one per line, as vLLM's default.
	got, err := tokenizer.RenderChat([]openai.Message{{Role: "user", Content: json.RawMessage(`[{"type":"text","text":"Hi"},{"type":"image_url","image_url":{"url":"u"}}]`)}})
	if want := "<|user|>\n<image>\nHi\n<|assistant|>\n"; err != nil || got != want {
		t.Errorf("RenderChat = %q, %v; want %q", got, err, want)
	}

	for _, tc := range []struct {
		name string
		part any
		msg  string
	}{
		{"unknown type", map[string]any{"type": "hologram", "hologram": "x"}, "Unknown part type: hologram"},
		{"image without url", map[string]any{"type": "image_url"}, "image_url"},
		{"image url not a string", map[string]any{"type": "image_url", "image_url": map[string]any{"url": 3}}, "image_url.url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := map[string]any{"model": "pdq-sim", "messages": user([]any{tc.part, text("x")})}
			call(t, http.MethodPost, e.URL+"/v1/chat/completions", b).apiError(t, http.StatusBadRequest, tc.msg)
		})
	}

	// A decode engine given the KV of another image says that image's
	// answer, and counts a mismatch.
	p, d := simtest.Start(t, fast(nil)), simtest.Start(t, fast(nil))
	msg := func(url string) []any { return user([]any{image(url), text("What is this?")}) }
	pr := chat(t, p, map[string]any{"model": "pdq-sim", "messages": msg("cat"), "max_tokens": 1, "kv_transfer_params": prefillParams}, "X-Request-Id", "mm-1")
	var params any
	json.Unmarshal(pr.KVTransferParams, &params)
	chat(t, d, map[string]any{"model": "pdq-sim", "messages": msg("dog"), "max_tokens": 5, "kv_transfer_params": params}, "X-Request-Id", "mm-1")
	if s := d.Stats(t); s.KVReads != 1 || s.KVMismatches != 1 {
		t.Errorf("decode stats = %+v; want the other image's KV caught", s)
	}
}

func TestBatchedCompletions(t *testing.T) {
	e := simtest.Start(t, fast(nil))
	prompts := []string{"The first prompt", "Another, longer prompt here", "third"}
	single := make([]openai.Completion, len(prompts))
	for i, p := range prompts {
		single[i] = completion(t, e, map[string]any{"model": "pdq-sim", "prompt": p, "max_tokens": 6, "ignore_eos": true})
	}

	t.Run("non-streamed", func(t *testing.T) {
		c := completion(t, e, map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 6, "ignore_eos": true}, "X-Request-Id", "batch-1")
		if c.ID != "cmpl-batch-1" || len(c.Choices) != 3 {
			t.Fatalf("response = %+v", c)
		}
		var wantPrompt int
		for i, ch := range c.Choices {
			if ch.Index != i || ch.Text != single[i].Choices[0].Text || *ch.FinishReason != "length" {
				t.Errorf("choice %d = %+v, want the text %q", i, ch, single[i].Choices[0].Text)
			}
			wantPrompt += single[i].Usage.PromptTokens
		}
		if c.Usage.PromptTokens != wantPrompt || c.Usage.CompletionTokens != 18 || c.Usage.TotalTokens != wantPrompt+18 {
			t.Errorf("usage = %+v", c.Usage)
		}
		// Token-id prompts: one choice per list.
		ids := completion(t, e, map[string]any{"model": "pdq-sim", "prompt": [][]int{{1, 2, 3}, {4, 5}}, "max_tokens": 2})
		if len(ids.Choices) != 2 || ids.Usage.PromptTokens != 5 {
			t.Errorf("token batch = %+v", ids)
		}
	})

	t.Run("streamed", func(t *testing.T) {
		b := map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 6, "ignore_eos": true, "stream": true,
			"stream_options": map[string]any{"include_usage": true}}
		r := call(t, http.MethodPost, e.URL+"/v1/completions", b, "X-Request-Id", "batch-2").want(t, http.StatusOK)
		evs := events(t, r.body)
		if evs[len(evs)-1] != "[DONE]" {
			t.Fatalf("no [DONE]: %q", evs)
		}
		texts := make([]string, len(prompts))
		var usage *openai.Usage
		for _, ev := range evs[:len(evs)-1] {
			var c openai.CompletionChunk
			if err := json.Unmarshal([]byte(ev), &c); err != nil {
				t.Fatal(err)
			}
			if c.ID != "cmpl-batch-2" || c.Model != "pdq-sim" {
				t.Errorf("chunk = %s", ev)
			}
			if len(c.Choices) == 0 {
				usage = c.Usage
				continue
			}
			texts[c.Choices[0].Index] += c.Choices[0].Text
		}
		for i := range prompts {
			if texts[i] != single[i].Choices[0].Text {
				t.Errorf("stream of prompt %d said %q, want %q", i, texts[i], single[i].Choices[0].Text)
			}
		}
		if usage == nil || usage.CompletionTokens != 18 || usage.PromptTokens != single[0].Usage.PromptTokens+single[1].Usage.PromptTokens+single[2].Usage.PromptTokens {
			t.Errorf("final usage = %+v", usage)
		}
	})

	t.Run("streamed, dropped", func(t *testing.T) {
		d := simtest.Start(t, fast(func(c *simconfig.Config) { c.Fault = simconfig.Fault{Rate: 1, Kind: simconfig.FaultDrop} }))
		raw, _ := json.Marshal(map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 20, "ignore_eos": true, "stream": true})
		resp, err := http.Post(d.URL+"/v1/completions", "application/json", bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if body, err := io.ReadAll(resp.Body); err == nil && strings.Contains(string(body), "[DONE]") {
			t.Fatalf("the stream was not dropped: %s", body)
		}
		s := d.WaitStats(t, 5*time.Second, "batch ended", func(s sim.Stats) bool { return s.Running == 0 })
		if s.Faults != 1 || s.Aborts != 0 || s.Local == 3 {
			t.Errorf("stats = %+v; want one fault, no abort, not every prompt finished", s)
		}
	})

	t.Run("each prompt is checked", func(t *testing.T) {
		small := simtest.Start(t, fast(func(c *simconfig.Config) { c.MaxModelLen = 20 }))
		b := map[string]any{"model": "pdq-sim", "prompt": []string{"short", strings.Repeat("w ", 15)}, "max_tokens": 8}
		call(t, http.MethodPost, small.URL+"/v1/completions", b).apiError(t, http.StatusBadRequest,
			"'max_tokens' or 'max_completion_tokens' is too large: 8. This model's maximum context length is 20 tokens and your request has 15 input tokens")
		b["prompt"] = []string{"short", strings.Repeat("w ", 25)}
		call(t, http.MethodPost, small.URL+"/v1/completions", b).apiError(t, http.StatusBadRequest, "your request has 25 input tokens")
		if s := small.Stats(t); s.Local != 0 {
			t.Errorf("a refused batch ran: %+v", s)
		}
	})
}

// A batch in P/D: the prefill returns the params of prompt 0 only, as
// vLLM's completion serving does, while every prompt's blocks are held; a
// decode engine given them reads prompt 0's blocks for the first prompt
// and finds none for the others.
func TestBatchPrefillDecode(t *testing.T) {
	prompts := []string{strings.Repeat("alpha ", 40), strings.Repeat("bravo ", 20)}
	p := simtest.Start(t, fast(nil))
	pr := completion(t, p, map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 1, "kv_transfer_params": prefillParams}, "X-Request-Id", "pd-batch")
	if len(pr.Choices) != 2 || len(pr.KVTransferParams) == 0 || string(pr.KVTransferParams) == "null" {
		t.Fatalf("prefill = %+v", pr)
	}
	var params map[string]any
	json.Unmarshal(pr.KVTransferParams, &params)
	if id, _ := params["remote_request_id"].(string); !strings.HasPrefix(id, "cmpl-pd-batch-0-") {
		t.Errorf("remote_request_id = %v, want prompt 0's", params["remote_request_id"])
	}
	// 40 tokens = 3 blocks, 20 = 2: both prompts hold theirs.
	if s := p.Stats(t); s.Prefills != 2 || s.BlocksHeld != 5 {
		t.Errorf("prefill stats = %+v", s)
	}

	for _, policy := range []simconfig.LoadFailurePolicy{simconfig.LoadFailureFail, simconfig.LoadFailureRecompute} {
		t.Run(string(policy), func(t *testing.T) {
			p := simtest.Start(t, fast(nil))
			d := simtest.Start(t, fast(func(c *simconfig.Config) { c.KVLoadFailure = policy }))
			pr := completion(t, p, map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 1, "kv_transfer_params": prefillParams}, "X-Request-Id", "pd-b")
			var params any
			json.Unmarshal(pr.KVTransferParams, &params)
			b := map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 4, "ignore_eos": true, "kv_transfer_params": params}
			r := call(t, http.MethodPost, d.URL+"/v1/completions", b, "X-Request-Id", "pd-b")
			if policy == simconfig.LoadFailureFail {
				r.apiError(t, http.StatusInternalServerError, "failed to load KV cache")
			} else {
				r.want(t, http.StatusOK)
				var c openai.Completion
				r.decode(t, &c)
				plain := completion(t, simtest.Start(t, fast(nil)), map[string]any{"model": "pdq-sim", "prompt": prompts, "max_tokens": 4, "ignore_eos": true})
				for i := range prompts {
					if c.Choices[i].Text != plain.Choices[i].Text {
						t.Errorf("prompt %d said %q, want %q", i, c.Choices[i].Text, plain.Choices[i].Text)
					}
				}
			}
			s := d.Stats(t)
			if s.KVReads != 1 || s.KVReadFailures != 1 || s.KVMismatches != 0 {
				t.Errorf("decode stats = %+v", s)
			}
			// Prompt 0's blocks are freed by the read; prompt 1's wait for
			// their lease.
			if ps := p.Stats(t); ps.BlocksHeld != 2 {
				t.Errorf("prefill holds %d blocks, want prompt 1's 2", ps.BlocksHeld)
			}
		})
	}
}
