package tests

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// longPrompt is long enough to go through prefill at the default threshold.
const longPrompt = "Please explain, in a few sentences, how a prefill engine hands its KV cache to a decode engine."

// TestGatewayBadInput checks that bad requests get an OpenAI error with the
// right status, before anything is queued.
func TestGatewayBadInput(t *testing.T) {
	p := startPipeline(t, pipelineOptions{gateway: gateway.Config{MaxBodyBytes: 64 << 10}})
	chat, comp := p.chat(), p.completions()
	for _, tc := range []struct {
		name   string
		url    string
		id     string
		body   any
		status int
		msg    string
	}{
		{"malformed JSON", chat, "", `{"model": "pdq-sim", "messages": [`, 400, "malformed JSON"},
		{"trailing data", comp, "", `{"model":"pdq-sim","prompt":"x"}}`, 400, "malformed JSON"},
		{"wrong type", chat, "", `{"model":"pdq-sim","messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}`, 400, "max_tokens"},
		{"messages not a list", chat, "", `{"model":"pdq-sim","messages":"hi"}`, 400, "messages"},
		{"missing messages", chat, "", body{"model": model}, 400, "'messages' is required"},
		{"missing prompt", comp, "", body{"model": model}, 400, "'prompt' is required"},
		// Any printable id is served (tests/vllm_api_test.go); these are not.
		{"X-Request-Id with a tab", chat, "a\tb", chatBody(model, "x", nil), 400, "X-Request-Id"},
		{"X-Request-Id too long", chat, strings.Repeat("x", 257), chatBody(model, "x", nil), 400, "X-Request-Id"},
		{"unknown model", chat, "", chatBody("gpt-9", "x", nil), 404, "does not exist"},
		{"oversized body", comp, "", completionBody(model, strings.Repeat("x", 70<<10), nil), 413, "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := post(t, tc.url, tc.id, tc.body)
			r.wantStatus(t, tc.status)
			e := r.apiError(t)
			if e.Code != tc.status || e.Type != openai.ErrorType(tc.status) || !strings.Contains(e.Message, tc.msg) {
				t.Errorf("error = %+v; want code %d and %q", e, tc.status, tc.msg)
			}
			if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Errorf("Content-Type = %q", ct)
			}
		})
	}
	t.Run("unknown route and method", func(t *testing.T) {
		get(t, p.url+"/v1/nothing").wantStatus(t, http.StatusNotFound)
		r := get(t, p.chat())
		r.wantStatus(t, http.StatusMethodNotAllowed)
		r.apiError(t)
	})
	for _, e := range append(p.prefill, p.decode...) {
		if s := e.Stats(t); s.Requests != 0 {
			t.Errorf("a bad request reached an engine: %+v", s)
		}
	}
	// Nothing was queued either.
	for _, name := range []string{dispatcher.StreamPrefill, dispatcher.StreamDecode} {
		st, err := p.js.Stream(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		if info, _ := st.Info(context.Background()); info.State.Msgs != 0 || info.State.LastSeq != 0 {
			t.Errorf("stream %s holds %+v", name, info.State)
		}
	}
}

// TestGatewayDropsClientKVParams sends kv_transfer_params that would make a
// decode engine read blocks from an address that does not answer. The
// gateway must drop them: the request succeeds, on the path it would have
// taken anyway.
func TestGatewayDropsClientKVParams(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	evil := map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_request_id": "x",
		"remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": []int{1}}
	short := chatBody(model, "hi", body{"max_tokens": 3, "kv_transfer_params": evil})
	parseResponse(t, post(t, p.chat(), "", short))
	long := completionBody(model, longPrompt, body{"max_tokens": 3, "kv_transfer_params": evil, "stream": true})
	parseStream(t, postStream(t, p.completions(), "", long), openai.Completions, false)
	d := p.decode[0].Stats(t)
	if d.Local != 1 || d.Decodes != 1 || d.KVReads != 1 || d.KVReadFailures != 0 {
		t.Errorf("decode stats = %+v; want one decode-only, one P/D, no failed read", d)
	}
}

// TestGatewayRequestIDs checks that the client's id is echoed and reaches
// both engines, and that a reused id is refused rather than dropped.
func TestGatewayRequestIDs(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.Protocol = simconfig.ProtocolV1 // one id on both legs, or the decode engine dies
	p := startPipeline(t, pipelineOptions{sim: cfg})

	r := post(t, p.chat(), "client-id-1", chatBody(model, longPrompt, body{"max_tokens": 2}))
	res, _ := parseResponse(t, r)
	if r.header.Get("X-Request-Id") != "client-id-1" || res.id != "chatcmpl-client-id-1" {
		t.Errorf("X-Request-Id %q, response id %q", r.header.Get("X-Request-Id"), res.id)
	}
	if s := p.decode[0].Stats(t); s.KVReads != 1 || s.EngineDead {
		t.Errorf("decode stats = %+v", s)
	}

	t.Run("reused within the dedup window", func(t *testing.T) {
		r := post(t, p.chat(), "client-id-1", chatBody(model, longPrompt, body{"max_tokens": 2}))
		r.wantStatus(t, http.StatusConflict)
		if r.apiError(t).Type != "ConflictError" || r.header.Get("X-Request-Id") != "client-id-1" {
			t.Errorf("409 = %s %v", r.body, r.header)
		}
	})
	t.Run("reused while in flight", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		resp, err := send(ctx, p.chat(), "busy-id", chatBody(model, longPrompt, body{"max_tokens": 5000, "ignore_eos": true, "stream": true}))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if _, err := openai.NewSSEReader(resp.Body).Next(); err != nil {
			t.Fatal(err)
		}
		post(t, p.chat(), "busy-id", chatBody(model, "x", nil)).wantStatus(t, http.StatusConflict)
	})
}

// TestGatewayCancel checks that a client who leaves a stream stops the
// engine's work, with the replies over NATS and in memory (pdq up).
func TestGatewayCancel(t *testing.T) {
	t.Run("over NATS", func(t *testing.T) { testGatewayCancel(t, false) })
	t.Run("in process", func(t *testing.T) { testGatewayCancel(t, true) })
}

func testGatewayCancel(t *testing.T, local bool) {
	cfg := simtest.FastConfig()
	cfg.ITL = 5 * time.Millisecond
	p := startPipeline(t, pipelineOptions{sim: cfg, local: local})
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := send(ctx, p.chat(), "", chatBody(model, longPrompt, body{"max_tokens": 5000, "ignore_eos": true, "stream": true}))
	if err != nil {
		t.Fatal(err)
	}
	r := openai.NewSSEReader(resp.Body)
	for range 3 {
		if _, err := r.Next(); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	resp.Body.Close()
	p.decode[0].WaitStats(t, 10*time.Second, "decode aborted", func(s sim.Stats) bool { return s.Aborts == 1 && s.Running == 0 })
}

// TestGatewayNoWorkers checks a model whose prefill pool has no live
// worker: short prompts are served decode-only as always; long ones too,
// by the decode-only fallback, or, with PDQ_PREFILL_FALLBACK=fail, refused
// with a 503 and Retry-After.
func TestGatewayNoWorkers(t *testing.T) {
	p := startPipeline(t, pipelineOptions{prefill: -1})
	parseResponse(t, post(t, p.chat(), "", chatBody(model, "hi", body{"max_tokens": 2})))
	parseResponse(t, post(t, p.chat(), "fallback-1", chatBody(model, longPrompt, body{"max_tokens": 2})))
	var rec dispatcher.Record
	get(t, p.url+"/v1/requests/fallback-1").decode(t, &rec)
	if !rec.DecodeOnly || rec.State != dispatcher.StateDone {
		t.Errorf("record %+v, want done decode-only", rec)
	}

	p = startPipeline(t, pipelineOptions{prefill: -1, gateway: gateway.Config{PrefillFallback: config.FallbackFail}})
	r := post(t, p.chat(), "", chatBody(model, longPrompt, body{"max_tokens": 2}))
	r.wantStatus(t, http.StatusServiceUnavailable)
	if r.header.Get("Retry-After") == "" || !strings.Contains(r.apiError(t).Message, "prefill") {
		t.Errorf("503 = %s, Retry-After %q", r.body, r.header.Get("Retry-After"))
	}
}

// TestEngineErrors checks what the promised failure handling looks like
// from the client: an engine's 4xx comes back as it was, a transient 503
// is retried, and a prefill that keeps answering without kv_transfer_params
// fails with a 502 and lands in the dead-letter stream.
func TestEngineErrors(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxModelLen = 200
	p := startPipeline(t, pipelineOptions{sim: cfg})

	t.Run("engine 4xx passes through", func(t *testing.T) {
		r := post(t, p.completions(), "", completionBody(model, strings.Repeat("word ", 300), nil))
		r.wantStatus(t, http.StatusBadRequest)
		if e := r.apiError(t); !strings.Contains(e.Message, "maximum context length is 200") {
			t.Errorf("error = %+v; want the engine's message", e)
		}
	})

	t.Run("transient 503 is retried", func(t *testing.T) {
		setFault(t, p.decode[0], `{"rate":1,"kind":"503"}`)
		done := make(chan response, 1)
		go func() {
			r, err := tryPost(p.chat(), "", chatBody(model, longPrompt, body{"max_tokens": 4, "ignore_eos": true}))
			if err != nil {
				t.Error(err)
			}
			done <- r
		}()
		p.decode[0].WaitStats(t, 10*time.Second, "a refused decode", func(s sim.Stats) bool { return s.Faults >= 1 })
		setFault(t, p.decode[0], `{"rate":0}`)
		res, _ := parseResponse(t, <-done)
		if res.usage.CompletionTokens != 4 {
			t.Errorf("result = %+v", res)
		}
	})

	t.Run("no kv_transfer_params is an error, not a recompute", func(t *testing.T) {
		setFault(t, p.prefill[0], `{"rate":1,"kind":"no-kv"}`)
		defer setFault(t, p.prefill[0], `{"rate":0}`)
		before := p.decode[0].Stats(t)
		r := post(t, p.chat(), "no-kv-1", chatBody(model, longPrompt, body{"max_tokens": 4}))
		r.wantStatus(t, http.StatusBadGateway)
		if e := r.apiError(t); !strings.Contains(e.Message, "kv_transfer_params") || !strings.Contains(e.Message, "4 attempts") {
			t.Errorf("error = %+v", e)
		}
		if s := p.prefill[0].Stats(t); s.Faults != int64(config.DefaultMaxDeliver) {
			t.Errorf("prefill ran %d times, want %d", s.Faults, config.DefaultMaxDeliver)
		}
		if after := p.decode[0].Stats(t); after.Requests != before.Requests {
			t.Errorf("the decode engine got the request anyway: %+v", after)
		}
		st, err := p.js.Stream(context.Background(), dispatcher.StreamDLQ)
		if err != nil {
			t.Fatal(err)
		}
		m, err := st.GetLastMsgForSubject(context.Background(), dispatcher.DLQSubject(dispatcher.PoolName(model), "no-kv-1"))
		if err != nil {
			t.Fatalf("no dead letter: %v", err)
		}
		job, err := dispatcher.ParseJob(m.Header, m.Data)
		if err != nil || job.ID != "no-kv-1" || m.Header.Get(dispatcher.HeaderStage) != "prefill" || !json.Valid(m.Data) {
			t.Errorf("dead letter %s %v: %v", m.Data, m.Header, err)
		}
	})
}

// TestGatewayAPIKeys checks PDQ_API_KEYS: /v1 needs one of the keys,
// /health and /ready do not.
func TestGatewayAPIKeys(t *testing.T) {
	p := startPipeline(t, pipelineOptions{gateway: gateway.Config{APIKeys: []string{"k1", "k2"}}})
	b := chatBody(model, "hi", body{"max_tokens": 2})
	for _, h := range []http.Header{nil, {"Authorization": {"Bearer nope"}}, {"Authorization": {"k1"}}} {
		r := do(t, http.MethodPost, p.chat(), h, b)
		r.wantStatus(t, http.StatusUnauthorized)
		r.apiError(t)
	}
	do(t, http.MethodGet, p.url+"/v1/models", nil, nil).wantStatus(t, http.StatusUnauthorized)
	for _, k := range []string{"k1", "k2"} {
		parseResponse(t, do(t, http.MethodPost, p.chat(), http.Header{"Authorization": {"Bearer " + k}}, b))
	}
	get(t, p.url+"/health").wantStatus(t, http.StatusOK)
	get(t, p.url+"/ready").wantStatus(t, http.StatusOK)
}

// TestRecordsByKey: with PDQ_API_KEYS, a key reads the records of its own
// requests (a replay's kept answer among them), not another key's; an
// operator key (PDQ_OPERATOR_KEYS) reads every record, and is a key for
// the rest of /v1 too.
func TestRecordsByKey(t *testing.T) {
	p := startPipeline(t, pipelineOptions{gateway: gateway.Config{APIKeys: []string{"alice", "bob"}, OperatorKeys: []string{"ops"}}})
	as := func(key string) http.Header {
		return http.Header{"Authorization": {"Bearer " + key}, "X-Request-Id": {"rec-" + key}}
	}
	b := chatBody(model, "hi", body{"max_tokens": 2})
	for _, key := range []string{"alice", "ops"} {
		parseResponse(t, do(t, http.MethodPost, p.chat(), as(key), b))
	}
	for _, tc := range []struct {
		key, id string
		want    int
	}{
		{"alice", "rec-alice", http.StatusOK},
		{"bob", "rec-alice", http.StatusNotFound},
		{"ops", "rec-alice", http.StatusOK},
		{"alice", "rec-ops", http.StatusNotFound},
		{"ops", "rec-ops", http.StatusOK},
		{"nope", "rec-alice", http.StatusUnauthorized},
	} {
		r := do(t, http.MethodGet, p.url+"/v1/requests/"+tc.id, http.Header{"Authorization": {"Bearer " + tc.key}}, nil)
		if r.status != tc.want {
			t.Errorf("key %s reads %s: %d %s, want %d", tc.key, tc.id, r.status, r.body, tc.want)
		}
	}
}

// TestPools runs two models behind one gateway. Each model has its own
// pool: its jobs reach only its own engines, and /v1/models lists both.
func TestPools(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	other := simtest.FastConfig()
	other.Model = "meta-llama/Llama-3.1-8B-Instruct" // '/' and '.' must not leak into subjects
	op, od := simtest.Start(t, other), simtest.Start(t, other)
	p.startWorker(dispatcher.StagePrefill, op.URL, 0)
	p.startWorker(dispatcher.StageDecode, od.URL, 0)
	p.waitWorkers(4)

	var list openai.ModelList
	get(t, p.url+"/v1/models").decode(t, &list)
	if len(list.Data) != 2 || list.Data[0].ID != other.Model || list.Data[1].ID != model {
		t.Fatalf("models = %+v", list.Data)
	}
	for i := range 6 {
		m := model
		if i%2 == 1 {
			m = other.Model
		}
		res, _ := parseResponse(t, post(t, p.chat(), "", chatBody(m, longPrompt, body{"max_tokens": 3, "ignore_eos": true})))
		if res.usage.CompletionTokens != 3 {
			t.Errorf("%s: %+v", m, res)
		}
	}
	for name, e := range map[string]*simtest.Engine{"pdq-sim prefill": p.prefill[0], "pdq-sim decode": p.decode[0], "llama prefill": op, "llama decode": od} {
		s := e.Stats(t)
		if s.Requests != 3 || s.Errors != 0 {
			t.Errorf("%s engine got %d requests (%d errors), want 3 of its own model", name, s.Requests, s.Errors)
		}
	}
}

// TestLongPrompt sends a 3 MiB prompt through P/D: more than NATS's default
// 1 MiB max_payload, which the embedded server raises to 8 MiB.
func TestLongPrompt(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	prompt := strings.Repeat("x", 3<<20) // one long word: a single token to the simulator
	res, _ := parseResponse(t, post(t, p.completions(), "", completionBody(model, prompt, body{"max_tokens": 2, "ignore_eos": true})))
	if res.usage.CompletionTokens != 2 {
		t.Errorf("result = %+v", res)
	}
	if s := p.decode[0].Stats(t); s.KVReads != 1 {
		t.Errorf("decode stats = %+v; want the long prompt to go through P/D", s)
	}
}
