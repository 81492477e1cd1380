package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// These tests play a router against two simulated engines, the way vLLM's
// toy_proxy_server drives a prefill and a decode engine, and check that the
// simulator tells a correct handshake from the known broken ones.

const model = "pdq-sim"

// prefillBody is the prefill leg's body: the client's body with the
// kv_transfer_params skeleton, stream off, one output token, and without
// the fields a prefill does not support.
func prefillBody(b body) body {
	p := b.clone()
	p["kv_transfer_params"] = map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	}
	p["stream"] = false
	p["max_tokens"] = 1
	if _, ok := p["max_completion_tokens"]; ok {
		p["max_completion_tokens"] = 1
	}
	delete(p, "stream_options")
	delete(p, "min_tokens")
	delete(p, "min_completion_tokens")
	return p
}

// decodeBody is the decode leg's body: the client's body plus the params
// the prefill returned, unchanged.
func decodeBody(b body, params json.RawMessage) body {
	d := b.clone()
	var p any
	if err := json.Unmarshal(params, &p); err != nil {
		panic(err)
	}
	d["kv_transfer_params"] = p
	return d
}

// runPrefill sends the prefill leg and returns the kv_transfer_params.
func runPrefill(t *testing.T, engine *simtest.Engine, ep openai.Endpoint, id string, b body) json.RawMessage {
	t.Helper()
	res, params := parseResponse(t, post(t, engine.URL+ep.Path(), id, prefillBody(b)))
	if res.usage.CompletionTokens != 1 || res.finish != openai.FinishLength {
		t.Fatalf("prefill: %d tokens, finish %q; want 1, length", res.usage.CompletionTokens, res.finish)
	}
	if len(params) == 0 || string(params) == "null" {
		t.Fatal("prefill returned no kv_transfer_params")
	}
	return params
}

// editParams returns params with key set to v.
func editParams(t *testing.T, params json.RawMessage, key string, v any) json.RawMessage {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(params, &m); err != nil {
		t.Fatal(err)
	}
	m[key] = v
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func protocolConfig(p simconfig.Protocol, policy simconfig.LoadFailurePolicy) simconfig.Config {
	c := simtest.FastConfig()
	c.Protocol = p
	c.KVLoadFailure = policy
	return c
}

// TestSeedIncident plays the incident pdq exists to prevent: a router that
// sends one X-Request-Id to the prefill leg and another to the decode leg.
// Against v1 engines the decode engine dies, and stays dead; with one id
// the same flow works and frees the prefill's blocks.
func TestSeedIncident(t *testing.T) {
	b := chatBody(model, "Explain disaggregated prefill in one paragraph.", body{"max_tokens": 12, "ignore_eos": true})

	t.Run("two ids kill a v1 decode engine", func(t *testing.T) {
		p := simtest.Start(t, protocolConfig(simconfig.ProtocolV1, simconfig.LoadFailureFail))
		d := simtest.Start(t, protocolConfig(simconfig.ProtocolV1, simconfig.LoadFailureFail))

		params := runPrefill(t, p, openai.Chat, "req-A", b)
		r := post(t, d.URL+openai.Chat.Path(), "req-B", decodeBody(b, params))
		r.wantStatus(t, http.StatusInternalServerError)
		if e := r.apiError(t); !strings.Contains(e.Message, "EngineCore") {
			t.Errorf("error message %q does not say the engine failed", e.Message)
		}
		if h := get(t, d.URL+"/health"); h.status != http.StatusServiceUnavailable {
			t.Errorf("decode /health = %d after the crash, want 503", h.status)
		}

		// Every later request fails too, even a correct one.
		params = runPrefill(t, p, openai.Chat, "req-C", b)
		post(t, d.URL+openai.Chat.Path(), "req-C", decodeBody(b, params)).wantStatus(t, http.StatusInternalServerError)
		post(t, d.URL+openai.Chat.Path(), "", b).wantStatus(t, http.StatusInternalServerError)

		ds := d.Stats(t)
		if !ds.EngineDead || ds.KVReadFailures != 1 || ds.KVReads != 0 || ds.Decodes != 0 {
			t.Errorf("decode stats = %+v; want engine_dead, 1 read failure, no reads", ds)
		}
		if ps := p.Stats(t); ps.BlocksHeld == 0 || ps.KVServed != 0 {
			t.Errorf("prefill stats = %+v; want blocks still held and none served", ps)
		}
	})

	t.Run("one id works on v1", func(t *testing.T) {
		p := simtest.Start(t, protocolConfig(simconfig.ProtocolV1, simconfig.LoadFailureFail))
		d := simtest.Start(t, protocolConfig(simconfig.ProtocolV1, simconfig.LoadFailureFail))

		params := runPrefill(t, p, openai.Chat, "req-A", b)
		var kv map[string]any
		json.Unmarshal(params, &kv)
		if _, ok := kv["remote_request_id"]; ok {
			t.Errorf("a v1 prefill returned remote_request_id: %s", params)
		}
		got, _ := parseResponse(t, post(t, d.URL+openai.Chat.Path(), "req-A", decodeBody(b, params)))
		if got.id != "chatcmpl-req-A" || got.usage.CompletionTokens != 12 {
			t.Errorf("decode result = %+v; want id chatcmpl-req-A and 12 tokens", got)
		}
		// The decode must say what a plain engine says for the same prompt.
		local, _ := parseResponse(t, post(t, simtest.Start(t, protocolConfig(simconfig.ProtocolV1, simconfig.LoadFailureFail)).URL+openai.Chat.Path(), "", b))
		if got.text != local.text {
			t.Errorf("P/D text %q != local text %q", got.text, local.text)
		}

		ps := p.Stats(t)
		if ps.BlocksHeld != 0 || ps.Prefills != 1 || ps.KVServed != 1 {
			t.Errorf("prefill stats = %+v; want 1 prefill, 1 read served, 0 blocks held", ps)
		}
		ds := d.Stats(t)
		if ds.KVReads != 1 || ds.Decodes != 1 || ds.EngineDead || ds.KVReadFailures != 0 || ds.Recomputes != 0 {
			t.Errorf("decode stats = %+v; want 1 read, 1 decode, alive", ds)
		}
	})

	t.Run("two ids on v2 still work but are counted", func(t *testing.T) {
		p := simtest.Start(t, protocolConfig(simconfig.ProtocolV2, simconfig.LoadFailureFail))
		d := simtest.Start(t, protocolConfig(simconfig.ProtocolV2, simconfig.LoadFailureFail))
		params := runPrefill(t, p, openai.Chat, "req-A", b)
		got, _ := parseResponse(t, post(t, d.URL+openai.Chat.Path(), "req-B", decodeBody(b, params)))
		if got.usage.CompletionTokens != 12 {
			t.Errorf("decode result = %+v", got)
		}
		if ps := p.Stats(t); ps.RequestIDMismatches != 1 || ps.BlocksHeld != 0 {
			t.Errorf("prefill stats = %+v; want 1 request id mismatch, 0 blocks held", ps)
		}
	})
}

// TestKVLoadFailures covers the ways a decode engine can fail to load a
// prefill's blocks. In v2 each one is a counted KV load failure that fails
// the request (policy fail) or recomputes it (policy recompute); the engine
// stays alive either way.
func TestKVLoadFailures(t *testing.T) {
	b := completionBody(model, "The quick brown fox jumps over the lazy dog.", body{"max_tokens": 6, "ignore_eos": true})
	for _, tc := range []struct {
		name   string
		break_ func(t *testing.T, params json.RawMessage) json.RawMessage
	}{
		{"unknown remote_request_id", func(t *testing.T, p json.RawMessage) json.RawMessage {
			return editParams(t, p, "remote_request_id", "cmpl-nobody-0-00000000")
		}},
		{"wrong remote_engine_id", func(t *testing.T, p json.RawMessage) json.RawMessage {
			return editParams(t, p, "remote_engine_id", "another-engine")
		}},
		{"unreachable remote_port", func(t *testing.T, p json.RawMessage) json.RawMessage {
			return editParams(t, p, "remote_port", 1)
		}},
		{"wrong remote_block_ids", func(t *testing.T, p json.RawMessage) json.RawMessage {
			return editParams(t, p, "remote_block_ids", []int{9999})
		}},
	} {
		t.Run(tc.name+"/fail", func(t *testing.T) {
			p := simtest.Start(t, protocolConfig(simconfig.ProtocolV2, simconfig.LoadFailureFail))
			d := simtest.Start(t, protocolConfig(simconfig.ProtocolV2, simconfig.LoadFailureFail))
			params := tc.break_(t, runPrefill(t, p, openai.Completions, "req-1", b))
			r := post(t, d.URL+openai.Completions.Path(), "req-1", decodeBody(b, params))
			r.wantStatus(t, http.StatusInternalServerError)
			if e := r.apiError(t); e.Type != "InternalServerError" || !strings.Contains(e.Message, "KV cache") {
				t.Errorf("error = %+v", e)
			}
			if s := d.Stats(t); s.KVReadFailures != 1 || s.Recomputes != 0 || s.EngineDead {
				t.Errorf("decode stats = %+v; want 1 read failure, alive", s)
			}
			if h := get(t, d.URL+"/health"); h.status != http.StatusOK {
				t.Errorf("decode /health = %d, want 200", h.status)
			}

			// The stream form reports the failure in the stream.
			sb := decodeBody(b, params)
			sb["stream"] = true
			s := postStream(t, d.URL+openai.Completions.Path(), "req-1", sb)
			if s.status != http.StatusOK || !s.done || len(s.events) != 1 || !strings.Contains(string(s.events[0]), `"error"`) {
				t.Errorf("stream = status %d, done %v, events %q; want one in-stream error then [DONE]", s.status, s.done, s.events)
			}
		})
		t.Run(tc.name+"/recompute", func(t *testing.T) {
			p := simtest.Start(t, protocolConfig(simconfig.ProtocolV2, simconfig.LoadFailureRecompute))
			d := simtest.Start(t, protocolConfig(simconfig.ProtocolV2, simconfig.LoadFailureRecompute))
			params := tc.break_(t, runPrefill(t, p, openai.Completions, "req-1", b))
			got, _ := parseResponse(t, post(t, d.URL+openai.Completions.Path(), "req-1", decodeBody(b, params)))
			local, _ := parseResponse(t, post(t, d.URL+openai.Completions.Path(), "", b))
			if got.text != local.text || got.usage.CompletionTokens != 6 {
				t.Errorf("recomputed text %q, want %q", got.text, local.text)
			}
			if s := d.Stats(t); s.KVReadFailures != 1 || s.Recomputes != 1 || s.KVReads != 0 {
				t.Errorf("decode stats = %+v; want 1 read failure, 1 recompute", s)
			}
		})
	}
}

// TestKVOfAnotherPrompt sends a decode engine the params of another
// request's prefill. vLLM would read the wrong blocks and answer 200 with
// the wrong text; the simulator does the same, and counts it.
func TestKVOfAnotherPrompt(t *testing.T) {
	p := simtest.Start(t, simtest.FastConfig())
	d := simtest.Start(t, simtest.FastConfig())
	first := chatBody(model, "What is the capital of France?", body{"max_tokens": 8, "ignore_eos": true})
	second := chatBody(model, "Write a haiku about routers.", body{"max_tokens": 8, "ignore_eos": true})

	params := runPrefill(t, p, openai.Chat, "req-1", first)
	got, _ := parseResponse(t, post(t, d.URL+openai.Chat.Path(), "req-1", decodeBody(second, params)))
	wrong, _ := parseResponse(t, post(t, d.URL+openai.Chat.Path(), "", first))
	right, _ := parseResponse(t, post(t, d.URL+openai.Chat.Path(), "", second))
	if got.text != wrong.text || got.text == right.text {
		t.Errorf("decode with the first prompt's KV said %q; want the first prompt's answer %q, not %q", got.text, wrong.text, right.text)
	}
	if s := d.Stats(t); s.KVMismatches != 1 || s.KVReads != 1 {
		t.Errorf("decode stats = %+v; want 1 mismatch", s)
	}
}

// TestPrefillWithoutMaxTokensOne checks that a prefill which runs to its
// natural end returns no params and holds no blocks, as vLLM returns
// kv_transfer_params only for a length-capped prefill.
func TestPrefillWithoutMaxTokensOne(t *testing.T) {
	p := simtest.Start(t, simtest.FastConfig())
	b := prefillBody(chatBody(model, "hello", nil))
	b["max_tokens"] = 1000
	res, params := parseResponse(t, post(t, p.URL+openai.Chat.Path(), "req-1", b))
	if res.finish != openai.FinishStop || string(params) != "null" {
		t.Errorf("finish %q, params %s; want stop and null", res.finish, params)
	}
	if s := p.Stats(t); s.BlocksHeld != 0 || s.Prefills != 0 {
		t.Errorf("stats = %+v; want nothing held", s)
	}
}

// TestLeaseExpiry checks that unread blocks are freed and counted when the
// lease runs out, that a decode engine then fails to load them, and that a
// decode request waiting for a slot keeps them alive with heartbeats.
func TestLeaseExpiry(t *testing.T) {
	b := chatBody(model, strings.Repeat("token ", 40), body{"max_tokens": 4, "ignore_eos": true})

	t.Run("unread blocks expire", func(t *testing.T) {
		cfg := simtest.FastConfig()
		cfg.KVLease = 100 * time.Millisecond
		p := simtest.Start(t, cfg)
		d := simtest.Start(t, simtest.FastConfig())
		params := runPrefill(t, p, openai.Chat, "req-1", b)
		var kv struct {
			Blocks []int `json:"remote_block_ids"`
		}
		json.Unmarshal(params, &kv)
		if len(kv.Blocks) == 0 {
			t.Fatalf("params %s have no blocks", params)
		}
		if s := p.Stats(t); s.BlocksHeld != int64(len(kv.Blocks)) {
			t.Fatalf("blocks_held = %d right after the prefill, want %d", s.BlocksHeld, len(kv.Blocks))
		}
		p.WaitStats(t, 10*time.Second, "lease expiry", func(s sim.Stats) bool {
			return s.BlocksHeld == 0 && s.BlocksExpired == int64(len(kv.Blocks)) && s.HoldsExpired == 1
		})
		post(t, d.URL+openai.Chat.Path(), "req-1", decodeBody(b, params)).wantStatus(t, http.StatusInternalServerError)
		if s := d.Stats(t); s.KVReadFailures != 1 {
			t.Errorf("decode stats = %+v; want 1 read failure", s)
		}
	})

	t.Run("heartbeats keep a queued decode's blocks", func(t *testing.T) {
		pcfg := simtest.FastConfig()
		pcfg.KVLease = 300 * time.Millisecond
		p := simtest.Start(t, pcfg)
		dcfg := simtest.FastConfig()
		dcfg.MaxNumSeqs = 1
		dcfg.KVHeartbeat = 30 * time.Millisecond
		dcfg.ITL = 10 * time.Millisecond
		d := simtest.Start(t, dcfg)

		// Fill the decode engine's only slot for about three leases.
		blocker := make(chan response, 1)
		go func() {
			r, err := tryPost(d.URL+openai.Chat.Path(), "", chatBody(model, "busy", body{"max_tokens": 100, "ignore_eos": true}))
			if err != nil {
				t.Error(err)
			}
			blocker <- r
		}()
		d.WaitStats(t, 5*time.Second, "blocker running", func(s sim.Stats) bool { return s.Running == 1 })
		params := runPrefill(t, p, openai.Chat, "req-1", b)
		got, _ := parseResponse(t, post(t, d.URL+openai.Chat.Path(), "req-1", decodeBody(b, params)))
		(<-blocker).wantStatus(t, http.StatusOK)
		if got.usage.CompletionTokens != 4 {
			t.Errorf("decode result = %+v", got)
		}
		if s := p.Stats(t); s.BlocksExpired != 0 || s.BlocksHeld != 0 || s.KVServed != 1 {
			t.Errorf("prefill stats = %+v; want the blocks read, not expired", s)
		}
	})
}

// TestPDBothEndpoints runs the full handshake for chat and completions,
// streamed and not, and checks that the decode says exactly what a plain
// engine says, with exact usage.
func TestPDBothEndpoints(t *testing.T) {
	p := simtest.Start(t, simtest.FastConfig())
	d := simtest.Start(t, simtest.FastConfig())
	plain := simtest.Start(t, simtest.FastConfig())
	n := 0
	for _, ep := range []openai.Endpoint{openai.Chat, openai.Completions} {
		for _, streamed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", ep, streamed), func(t *testing.T) {
				n++
				id := fmt.Sprintf("pd-%d", n)
				var b body
				if ep == openai.Chat {
					b = chatBody(model, "Tell me about NIXL, please.", body{"max_completion_tokens": 9, "ignore_eos": true})
				} else {
					b = completionBody(model, "Tell me about NIXL, please.", body{"max_tokens": 9, "ignore_eos": true})
				}
				want, _ := parseResponse(t, post(t, plain.URL+ep.Path(), id, b))

				params := runPrefill(t, p, ep, id, b)
				db := decodeBody(b, params)
				var got result
				if streamed {
					db["stream"] = true
					db["stream_options"] = map[string]any{"include_usage": true}
					got = parseStream(t, postStream(t, d.URL+ep.Path(), id, db), ep, true)
				} else {
					var kv json.RawMessage
					got, kv = parseResponse(t, post(t, d.URL+ep.Path(), id, db))
					if string(kv) != "null" {
						t.Errorf("decode response carries kv_transfer_params %s", kv)
					}
				}
				if got.id != ep.IDPrefix()+id {
					t.Errorf("id = %q, want %q", got.id, ep.IDPrefix()+id)
				}
				if got.text != want.text || got.finish != openai.FinishLength {
					t.Errorf("text %q finish %q; want %q, length", got.text, got.finish, want.text)
				}
				if got.usage != want.usage || got.usage.CompletionTokens != 9 {
					t.Errorf("usage %+v, want %+v with 9 completion tokens", got.usage, want.usage)
				}
			})
		}
	}
	ps, ds := p.Stats(t), d.Stats(t)
	if ps.Prefills != 4 || ps.KVServed != 4 || ps.BlocksHeld != 0 {
		t.Errorf("prefill stats = %+v", ps)
	}
	if ds.Decodes != 4 || ds.KVReads != 4 || ds.KVReadFailures != 0 || ds.Recomputes != 0 || ds.KVMismatches != 0 {
		t.Errorf("decode stats = %+v", ds)
	}
}
