package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// TestStreamFraming checks the bytes of a stream against vLLM's framing:
// "data: {json}\n\n" per event, the role chunk first, finish_reason with
// stop_reason on the last token, the usage chunk, then "data: [DONE]\n\n".
func TestStreamFraming(t *testing.T) {
	e := simtest.Start(t, simtest.FastConfig())
	b := chatBody(model, "hi", body{"max_tokens": 2, "ignore_eos": true, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := send(ctx, e.URL+openai.Chat.Path(), "frame-1", b)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("Content-Type = %q", ct)
	}
	events := strings.Split(string(raw), "\n\n")
	if len(events) != 6 || events[5] != "" {
		t.Fatalf("want 5 events each ending in a blank line, got %q", raw)
	}
	for i, ev := range events[:5] {
		if !strings.HasPrefix(ev, "data: ") || strings.Contains(ev, "\n") {
			t.Errorf("event %d = %q; want one data line", i, ev)
		}
	}
	prompt, _ := tokenizer.RenderChat([]openai.Message{{Role: "user", Content: json.RawMessage(`"hi"`)}})
	pt := tokenizer.CountTokens(prompt)
	var texts []string
	for _, i := range []int{1, 2} {
		var c openai.ChatChunk
		json.Unmarshal([]byte(strings.TrimPrefix(events[i], "data: ")), &c)
		texts = append(texts, *c.Choices[0].Delta.Content)
	}
	want := []string{
		`data: {"id":"chatcmpl-frame-1","object":"chat.completion.chunk","created":%d,"model":"pdq-sim","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		`data: {"id":"chatcmpl-frame-1","object":"chat.completion.chunk","created":%d,"model":"pdq-sim","choices":[{"index":0,"delta":{"content":"` + texts[0] + `"},"logprobs":null,"finish_reason":null}]}`,
		`data: {"id":"chatcmpl-frame-1","object":"chat.completion.chunk","created":%d,"model":"pdq-sim","choices":[{"index":0,"delta":{"content":"` + texts[1] + `"},"logprobs":null,"finish_reason":"length","stop_reason":null}]}`,
		`data: {"id":"chatcmpl-frame-1","object":"chat.completion.chunk","created":%d,"model":"pdq-sim","choices":[],"usage":{"prompt_tokens":` + fmt.Sprint(pt) + `,"completion_tokens":2,"total_tokens":` + fmt.Sprint(pt+2) + `}}`,
		`data: [DONE]`,
	}
	var first openai.ChatChunk
	json.Unmarshal([]byte(strings.TrimPrefix(events[0], "data: ")), &first)
	for i, w := range want {
		if strings.Contains(w, "%d") {
			w = fmt.Sprintf(w, first.Created)
		}
		if events[i] != w {
			t.Errorf("event %d:\n got %s\nwant %s", i, events[i], w)
		}
	}
}

// TestUsageAndLength checks usage counts against the simulator's
// tokenizer, the length rules (max_tokens, max_completion_tokens,
// ignore_eos, the model's natural end) and continuous usage stats.
func TestUsageAndLength(t *testing.T) {
	e := simtest.Start(t, simtest.FastConfig())
	prompt := "Count these words: one, two, three 42."
	chatPrompt, _ := tokenizer.RenderChat([]openai.Message{{Role: "user", Content: json.RawMessage(`"Count these words: one, two, three 42."`)}})

	for _, tc := range []struct {
		name       string
		ep         openai.Endpoint
		b          body
		wantPrompt int
		wantTokens int // 0: the model's natural length, which must stop before max
		wantFinish string
	}{
		{"chat max_tokens", openai.Chat, chatBody(model, prompt, body{"max_tokens": 7, "ignore_eos": true}), tokenizer.CountTokens(chatPrompt), 7, "length"},
		{"chat max_completion_tokens wins", openai.Chat, chatBody(model, prompt, body{"max_tokens": 50, "max_completion_tokens": 3, "ignore_eos": true}), tokenizer.CountTokens(chatPrompt), 3, "length"},
		{"completion", openai.Completions, completionBody(model, prompt, body{"max_tokens": 5, "ignore_eos": true}), tokenizer.CountTokens(prompt), 5, "length"},
		{"completion token ids", openai.Completions, body{"model": model, "prompt": []int{1, 2, 3, 4}, "max_tokens": 2, "ignore_eos": true}, 4, 2, "length"},
		{"natural end", openai.Completions, completionBody(model, prompt, body{"max_tokens": 1000}), tokenizer.CountTokens(prompt), 0, "stop"},
		{"min_tokens past the natural end", openai.Completions, completionBody(model, prompt, body{"max_tokens": 1000, "min_tokens": 300}), tokenizer.CountTokens(prompt), 300, "stop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, _ := parseResponse(t, post(t, e.URL+tc.ep.Path(), "", tc.b))
			if got.usage.PromptTokens != tc.wantPrompt {
				t.Errorf("prompt_tokens = %d, want %d", got.usage.PromptTokens, tc.wantPrompt)
			}
			if tc.wantTokens == 0 {
				if n := got.usage.CompletionTokens; n < 16 || n > 256 {
					t.Errorf("natural length %d outside 16..256", n)
				}
			} else if got.usage.CompletionTokens != tc.wantTokens {
				t.Errorf("completion_tokens = %d, want %d", got.usage.CompletionTokens, tc.wantTokens)
			}
			if got.usage.TotalTokens != got.usage.PromptTokens+got.usage.CompletionTokens {
				t.Errorf("total_tokens = %d", got.usage.TotalTokens)
			}
			if tok := tokenizer.CountTokens(got.text); tok != got.usage.CompletionTokens {
				t.Errorf("text %q has %d tokens, usage says %d", got.text, tok, got.usage.CompletionTokens)
			}
			if got.finish != tc.wantFinish {
				t.Errorf("finish_reason = %q, want %q", got.finish, tc.wantFinish)
			}
			// Streaming says the same thing.
			sb := tc.b.clone()
			sb["stream"] = true
			sb["stream_options"] = map[string]any{"include_usage": true}
			st := parseStream(t, postStream(t, e.URL+tc.ep.Path(), "", sb), tc.ep, true)
			if st.text != got.text || st.usage != got.usage || st.finish != got.finish {
				t.Errorf("stream said %+v, non-stream %+v", st, got)
			}
		})
	}

	t.Run("continuous usage stats", func(t *testing.T) {
		b := completionBody(model, prompt, body{"max_tokens": 3, "ignore_eos": true, "stream": true,
			"stream_options": map[string]any{"include_usage": true, "continuous_usage_stats": true}})
		s := postStream(t, e.URL+openai.Completions.Path(), "", b)
		if len(s.events) != 4 {
			t.Fatalf("events = %q", s.events)
		}
		for i, raw := range s.events[:3] {
			var c chunk
			json.Unmarshal(raw, &c)
			if c.Usage == nil || c.Usage.CompletionTokens != i+1 {
				t.Errorf("event %d usage = %+v, want %d completion tokens", i, c.Usage, i+1)
			}
		}
	})

	t.Run("deterministic and seeded", func(t *testing.T) {
		b := completionBody(model, prompt, body{"max_tokens": 10, "ignore_eos": true})
		a, _ := parseResponse(t, post(t, e.URL+openai.Completions.Path(), "", b))
		again, _ := parseResponse(t, post(t, e.URL+openai.Completions.Path(), "", b))
		cfg := simtest.FastConfig()
		cfg.Seed = 99
		other, _ := parseResponse(t, post(t, simtest.Start(t, cfg).URL+openai.Completions.Path(), "", b))
		if a.text != again.text || a.text == other.text {
			t.Errorf("seed 1 said %q then %q; seed 99 said %q", a.text, again.text, other.text)
		}
	})

	t.Run("request id from the body, else random", func(t *testing.T) {
		b := completionBody(model, prompt, body{"max_tokens": 1, "request_id": "body-id"})
		got, _ := parseResponse(t, post(t, e.URL+openai.Completions.Path(), "", b))
		if got.id != "cmpl-body-id" {
			t.Errorf("id = %q, want cmpl-body-id", got.id)
		}
		got, _ = parseResponse(t, post(t, e.URL+openai.Completions.Path(), "hdr-id", b))
		if got.id != "cmpl-hdr-id" {
			t.Errorf("id = %q, want the header's cmpl-hdr-id", got.id)
		}
		got, _ = parseResponse(t, post(t, e.URL+openai.Chat.Path(), "", chatBody(model, "x", body{"max_tokens": 1})))
		if !strings.HasPrefix(got.id, "chatcmpl-") || len(got.id) < len("chatcmpl-")+16 {
			t.Errorf("random id = %q", got.id)
		}
	})
}

// TestBadInput checks that bad requests get vLLM's error envelope and
// status, and never reach the engine.
func TestBadInput(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxModelLen = 100
	e := simtest.Start(t, cfg)
	chat, comp := e.URL+openai.Chat.Path(), e.URL+openai.Completions.Path()
	remote := map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": []int{1}}
	for _, tc := range []struct {
		name   string
		url    string
		body   any
		status int
		param  string
		msg    string
	}{
		{"malformed JSON", chat, `{"model":`, 400, "", "malformed JSON"},
		{"not JSON at all", chat, `hello`, 400, "", "malformed JSON"},
		{"empty body", chat, ``, 400, "", "empty"},
		{"array body", chat, `[1,2]`, 400, "", "JSON object"},
		{"wrong type", chat, `{"model":"pdq-sim","messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}`, 400, "max_tokens", "invalid type"},
		{"stream not a bool", comp, `{"model":"pdq-sim","prompt":"x","stream":"yes"}`, 400, "stream", "invalid type"},
		{"missing messages", chat, body{"model": model}, 400, "messages", "required"},
		{"message without role", chat, body{"model": model, "messages": []any{map[string]any{"content": "x"}}}, 400, "messages", "role"},
		{"image part without its url", chat, body{"model": model, "messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "image_url"}}}}}, 400, "messages", "'image_url' is required"},
		{"unknown part type", chat, body{"model": model, "messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "hologram"}}}}}, 400, "messages", "Unknown part type"},
		{"missing prompt", comp, body{"model": model}, 400, "prompt", "required"},
		{"a batch mixing text and tokens", comp, body{"model": model, "prompt": []any{"a", []int{1}}}, 400, "prompt", "mix"},
		{"empty prompt", comp, body{"model": model, "prompt": ""}, 400, "prompt", "empty"},
		{"unknown model", chat, chatBody("gpt-9", "x", nil), 404, "model", "does not exist"},
		{"n > 1", chat, chatBody(model, "x", body{"n": 2}), 400, "n", "n=1"},
		{"zero max_tokens", comp, completionBody(model, "x", body{"max_tokens": 0}), 400, "max_tokens", "at least 1"},
		{"prompt too long", comp, completionBody(model, strings.Repeat("w ", 100), nil), 400, "", "maximum context length is 100"},
		{"max_tokens too large", comp, completionBody(model, "x", body{"max_tokens": 100}), 400, "max_tokens", "too large"},
		{"min_tokens above max_tokens", comp, completionBody(model, "x", body{"max_tokens": 2, "min_tokens": 3}), 400, "min_tokens", "min_tokens"},
		{"kv params not an object", comp, completionBody(model, "x", body{"kv_transfer_params": "yes"}), 400, "kv_transfer_params", "object"},
		{"kv params wrong type", comp, completionBody(model, "x", body{"kv_transfer_params": map[string]any{"do_remote_decode": "yes"}}), 400, "kv_transfer_params", "invalid kv_transfer_params"},
		{"streamed prefill", comp, completionBody(model, "x", body{"stream": true, "kv_transfer_params": map[string]any{"do_remote_decode": true}}), 400, "stream", "stream=false"},
		{"both directions", comp, completionBody(model, "x", body{"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": true}}), 400, "kv_transfer_params", "both"},
		{"decode params missing keys", comp, completionBody(model, "x", body{"kv_transfer_params": map[string]any{"do_remote_prefill": true}}), 400, "kv_transfer_params", "remote_engine_id remote_host remote_request_id remote_port remote_block_ids"},
		{"decode params missing request id", comp, completionBody(model, "x", body{"kv_transfer_params": remote}), 400, "kv_transfer_params", "[remote_request_id]"},
		{"block ids not integers", comp, completionBody(model, "x", body{"kv_transfer_params": map[string]any{"do_remote_prefill": true, "remote_block_ids": []string{"DUMMY_ID"}}}), 400, "kv_transfer_params", "list of integers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := post(t, tc.url, "", tc.body)
			r.wantStatus(t, tc.status)
			apiErr := r.apiError(t)
			if apiErr.Code != tc.status || apiErr.Type != openai.ErrorType(tc.status) {
				t.Errorf("error = %+v; want code %d, type %s", apiErr, tc.status, openai.ErrorType(tc.status))
			}
			if !strings.Contains(apiErr.Message, tc.msg) {
				t.Errorf("message %q does not contain %q", apiErr.Message, tc.msg)
			}
			gotParam := ""
			if apiErr.Param != nil {
				gotParam = *apiErr.Param
			}
			if gotParam != tc.param {
				t.Errorf("param = %q, want %q", gotParam, tc.param)
			}
		})
	}
	if s := e.Stats(t); s.Local+s.Prefills+s.Decodes != 0 || s.Running != 0 || s.Errors == 0 {
		t.Errorf("stats = %+v; no bad request may reach the engine", s)
	}
	if h := get(t, e.URL+"/health"); h.status != http.StatusOK {
		t.Errorf("/health = %d after bad input", h.status)
	}
}

// TestQueueing checks --max-num-seqs: requests beyond it wait, then all
// finish.
func TestQueueing(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxNumSeqs = 2
	cfg.ITL = 5 * time.Millisecond
	e := simtest.Start(t, cfg)
	release := make(chan struct{})
	var wg sync.WaitGroup
	results := make([]response, 5)
	for i := range results {
		wg.Go(func() {
			// The first two are long, so the other three must wait.
			n := 10
			if i < 2 {
				n = 400
			}
			if i >= 2 {
				<-release
			}
			r, err := tryPost(e.URL+openai.Completions.Path(), "", completionBody(model, "q", body{"max_tokens": n, "ignore_eos": true}))
			if err != nil {
				t.Error(err)
			}
			results[i] = r
		})
	}
	e.WaitStats(t, 5*time.Second, "two running", func(s sim.Stats) bool { return s.Running == 2 })
	close(release)
	e.WaitStats(t, 5*time.Second, "three waiting", func(s sim.Stats) bool { return s.Running == 2 && s.Waiting == 3 })
	wg.Wait()
	for i, r := range results {
		if r.status != http.StatusOK {
			t.Errorf("request %d: status %d: %s", i, r.status, r.body)
		}
	}
	if s := e.Stats(t); s.Local != 5 || s.Running != 0 || s.Waiting != 0 {
		t.Errorf("stats = %+v", s)
	}
}

// TestAborts checks that a client that goes away aborts its request in the
// engine: while it runs, while it waits, and, for a decode, before it read
// the prefill's blocks (which the prefill engine must then free at once).
func TestAborts(t *testing.T) {
	t.Run("while streaming", func(t *testing.T) {
		cfg := simtest.FastConfig()
		cfg.ITL = 20 * time.Millisecond
		e := simtest.Start(t, cfg)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		resp, err := send(ctx, e.URL+openai.Chat.Path(), "", chatBody(model, "x", body{"max_tokens": 500, "ignore_eos": true, "stream": true}))
		if err != nil {
			t.Fatal(err)
		}
		r := openai.NewSSEReader(resp.Body)
		for range 3 {
			if _, err := r.Next(); err != nil {
				t.Fatal(err)
			}
		}
		resp.Body.Close()
		cancel()
		e.WaitStats(t, 5*time.Second, "abort", func(s sim.Stats) bool { return s.Aborts == 1 && s.Running == 0 })
		if s := e.Stats(t); s.Local != 0 || s.GenerationTokens != 0 {
			t.Errorf("an aborted request was counted as finished: %+v", s)
		}
	})

	t.Run("while non-streaming", func(t *testing.T) {
		cfg := simtest.FastConfig()
		cfg.ITL = 20 * time.Millisecond
		e := simtest.Start(t, cfg)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			defer cancel()
			if _, err := e.Poll(5*time.Second, func(s sim.Stats) bool { return s.Running == 1 }); err != nil {
				t.Errorf("request not running: %v", err)
			}
		}()
		if _, err := send(ctx, e.URL+openai.Completions.Path(), "", completionBody(model, "x", body{"max_tokens": 500, "ignore_eos": true})); err == nil {
			t.Fatal("request finished despite the cancel")
		}
		e.WaitStats(t, 5*time.Second, "abort", func(s sim.Stats) bool { return s.Aborts == 1 && s.Running == 0 })
	})

	t.Run("decode waiting for a slot frees the prefill's blocks", func(t *testing.T) {
		p := simtest.Start(t, simtest.FastConfig()) // 30s lease: only a release frees the blocks in time
		dcfg := simtest.FastConfig()
		dcfg.MaxNumSeqs = 1
		dcfg.ITL = 10 * time.Millisecond
		d := simtest.Start(t, dcfg)
		blockerCtx, stopBlocker := context.WithCancel(context.Background())
		defer stopBlocker()
		go send(blockerCtx, d.URL+openai.Chat.Path(), "", chatBody(model, "busy", body{"max_tokens": 2000, "ignore_eos": true}))
		d.WaitStats(t, 5*time.Second, "blocker running", func(s sim.Stats) bool { return s.Running == 1 })

		b := chatBody(model, strings.Repeat("long prompt ", 20), body{"max_tokens": 5})
		params := runPrefill(t, p, openai.Chat, "req-1", b)
		if s := p.Stats(t); s.BlocksHeld == 0 {
			t.Fatalf("prefill holds no blocks: %+v", s)
		}
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			defer cancel()
			if _, err := d.Poll(5*time.Second, func(s sim.Stats) bool { return s.Waiting == 1 }); err != nil {
				t.Errorf("decode not waiting: %v", err)
			}
		}()
		if _, err := send(ctx, d.URL+openai.Chat.Path(), "req-1", decodeBody(b, params)); err == nil {
			t.Fatal("decode finished despite the cancel")
		}
		p.WaitStats(t, 5*time.Second, "blocks released", func(s sim.Stats) bool { return s.BlocksHeld == 0 })
		if s := p.Stats(t); s.BlocksExpired != 0 || s.KVServed != 0 {
			t.Errorf("prefill stats = %+v; want the blocks released, not read or expired", s)
		}
		stopBlocker()
		d.WaitStats(t, 5*time.Second, "aborts", func(s sim.Stats) bool { return s.Aborts == 2 && s.Running == 0 && s.Waiting == 0 })
	})
}

// TestEndpoints checks the side routes: models, health, metrics, auth.
func TestEndpoints(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.APIKey = "sekret"
	cfg.Model = "meta-llama/Llama-3.1-8B-Instruct"
	e := simtest.Start(t, cfg)

	auth := http.Header{"Authorization": {"Bearer sekret"}}
	t.Run("models", func(t *testing.T) {
		get(t, e.URL+"/v1/models").wantStatus(t, http.StatusUnauthorized)
		r := do(t, http.MethodGet, e.URL+"/v1/models", auth, nil)
		r.wantStatus(t, http.StatusOK)
		var list openai.ModelList
		r.decode(t, &list)
		if list.Object != "list" || len(list.Data) != 1 || list.Data[0].ID != cfg.Model || list.Data[0].OwnedBy != "vllm" || list.Data[0].MaxModelLen != cfg.MaxModelLen {
			t.Errorf("models = %+v", list)
		}
	})
	t.Run("health", func(t *testing.T) {
		r := get(t, e.URL+"/health")
		if r.status != http.StatusOK || len(r.body) != 0 {
			t.Errorf("/health = %d %q; want 200 with an empty body", r.status, r.body)
		}
	})
	t.Run("auth", func(t *testing.T) {
		b := chatBody(cfg.Model, "x", body{"max_tokens": 1})
		r := post(t, e.URL+openai.Chat.Path(), "", b)
		r.wantStatus(t, http.StatusUnauthorized)
		if string(r.body) != `{"error":"Unauthorized"}` {
			t.Errorf("401 body = %s", r.body)
		}
		bad := http.Header{"Authorization": {"Bearer wrong"}}
		do(t, http.MethodPost, e.URL+openai.Chat.Path(), bad, b).wantStatus(t, http.StatusUnauthorized)
		do(t, http.MethodPost, e.URL+openai.Chat.Path(), auth, b).wantStatus(t, http.StatusOK)
		// Only /v1 needs the key, as in vLLM.
		get(t, e.URL+"/health").wantStatus(t, http.StatusOK)
	})
	t.Run("metrics", func(t *testing.T) {
		r := get(t, e.URL+"/metrics")
		r.wantStatus(t, http.StatusOK)
		for _, want := range []string{
			`vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0`,
			`vllm:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1`,
			`pdq_sim_local_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1`,
			`pdq_sim_blocks_held{`, `pdq_sim_engine_dead{`,
		} {
			if !strings.Contains(string(r.body), want) {
				t.Errorf("/metrics lacks %q", want)
			}
		}
	})
	t.Run("unknown route", func(t *testing.T) {
		r := get(t, e.URL+"/v2/nothing")
		r.wantStatus(t, http.StatusNotFound)
		r.apiError(t)
	})
}
