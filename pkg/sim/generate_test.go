package sim_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

func image(url string) map[string]any {
	return map[string]any{"type": "image_url", "image_url": map[string]any{"url": url}}
}

func text(s string) map[string]any { return map[string]any{"type": "text", "text": s} }

func TestMultimodalParts(t *testing.T) {
	e := simtest.Start(t, fast(func(c *sim.Config) { c.MMTokens = 20 }))
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
	got, err := sim.RenderChat([]openai.Message{{Role: "user", Content: json.RawMessage(`[{"type":"text","text":"Hi"},{"type":"image_url","image_url":{"url":"u"}}]`)}})
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
