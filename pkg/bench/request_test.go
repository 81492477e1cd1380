package bench

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// sseServer answers every POST with the given SSE lines, sleeping gap
// between them, and records the requests.
type sseServer struct {
	*httptest.Server
	mu      sync.Mutex
	bodies  [][]byte
	headers []http.Header
}

func newSSEServer(t *testing.T, status int, gap time.Duration, lines ...string) *sseServer {
	s := &sseServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.bodies = append(s.bodies, b)
		s.headers = append(s.headers, r.Header.Clone())
		s.mu.Unlock()
		if status != http.StatusOK {
			http.Error(w, `{"error":{"message":"no"}}`, status)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, l := range lines {
			time.Sleep(gap)
			io.WriteString(w, l)
			w.(http.Flusher).Flush()
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// request returns the body and headers of request i.
func (s *sseServer) request(i int) ([]byte, http.Header) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if i >= len(s.bodies) {
		return nil, nil
	}
	return s.bodies[i], s.headers[i]
}

func testClient(url string, chat bool) *client {
	return &client{http: http.DefaultClient, apiURL: url, chat: chat, model: "m", apiKey: "sk-test", origin: time.Now()}
}

func TestStreamTiming(t *testing.T) {
	const gap = 20 * time.Millisecond
	tests := []struct {
		name      string
		chat      bool
		lines     []string
		wantText  string
		wantITL   int
		wantOut   int
		wantIn    int
		wantError string
	}{
		{
			name: "completions",
			lines: []string{
				": ping\n\n",
				`data: {"choices":[{"index":0,"text":"a"}]}` + "\n\n",
				`data: {"choices":[{"index":0,"text":" b"}]}` + "\n\n",
				`data: {"choices":[{"index":0,"text":" c","finish_reason":"length"}]}` + "\n\n",
				`data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}` + "\n\n",
				"data: [DONE]\n\n",
			},
			wantText: "a b c", wantITL: 2, wantOut: 3, wantIn: 12,
		},
		{
			name: "chat: the role chunk is the first token",
			chat: true,
			lines: []string{
				`data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}` + "\n\n",
				`data: {"choices":[{"index":0,"delta":{"content":"x"}}]}` + "\n\n",
				`data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}` + "\n\n",
				"data: [DONE]\n\n",
			},
			wantText: "x", wantITL: 1, wantOut: 1, wantIn: 9,
		},
		{
			name:      "no choice is a failure",
			lines:     []string{`data: {"error":{"message":"boom"}}` + "\n\n", "data: [DONE]\n\n"},
			wantIn:    5,
			wantError: errNoChunk,
		},
		{
			name:     "no usage keeps the dataset's prompt length",
			lines:    []string{`data: {"choices":[{"text":"a"}]}` + "\n\n"},
			wantText: "a", wantIn: 5,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newSSEServer(t, http.StatusOK, gap, tt.lines...)
			c := testClient(srv.URL+"/v1/completions", tt.chat)
			out := c.do(context.Background(), SampleRequest{Prompt: "p", PromptLen: 5, OutputLen: 3, RequestID: "bench-1-0"})
			if tt.wantError != "" {
				if out.Success || out.Error != tt.wantError {
					t.Fatalf("success %v error %q, want failure %q", out.Success, out.Error, tt.wantError)
				}
				return
			}
			if !out.Success {
				t.Fatalf("failed: %s", out.Error)
			}
			if out.GeneratedText != tt.wantText || len(out.ITL) != tt.wantITL || out.OutputTokens != tt.wantOut || out.PromptLen != tt.wantIn {
				t.Errorf("text %q itl %v out %d in %d", out.GeneratedText, out.ITL, out.OutputTokens, out.PromptLen)
			}
			// Each line comes gap after the previous one: TTFT is the
			// first choice's arrival, latency the last choice's (not the
			// usage chunk's, not [DONE]'s).
			firstChoice := 1
			if tt.name == "completions" {
				firstChoice = 2
			}
			if out.TTFT < float64(firstChoice)*gap.Seconds() {
				t.Errorf("TTFT %v, want at least %v", out.TTFT, float64(firstChoice)*gap.Seconds())
			}
			// A gap can come out short when a busy machine reads two
			// chunks at once, but the last choice cannot arrive before it
			// was sent.
			sum := out.TTFT
			for _, g := range out.ITL {
				if g < 0 {
					t.Errorf("ITL gap %v: negative", g)
				}
				sum += g
			}
			if last := float64(firstChoice+len(out.ITL)) * gap.Seconds(); out.Latency < last {
				t.Errorf("latency %v, want at least %v: the last choice came before it was sent", out.Latency, last)
			}
			if d := out.Latency - sum; d < -1e-9 || d > 1e-9 {
				t.Errorf("latency %v is not TTFT plus the gaps (%v)", out.Latency, sum)
			}
			_, h := srv.request(0)
			if h.Get("X-Request-Id") != "bench-1-0" || h.Get("Authorization") != "Bearer sk-test" || h.Get("Content-Type") != "application/json" {
				t.Errorf("headers %v", h)
			}
		})
	}
}

func TestRequestBodies(t *testing.T) {
	req := SampleRequest{Prompt: "hello there", OutputLen: 7}
	tests := []struct {
		chat bool
		want string
	}{
		{false, `{"model":"m","prompt":"hello there","repetition_penalty":1,"max_tokens":7,"logprobs":null,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`},
		{true, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello there"}]}],"max_completion_tokens":7,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`},
	}
	for _, tt := range tests {
		b, err := testClient("", tt.chat).body(req)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != tt.want {
			t.Errorf("chat %v body:\n got %s\nwant %s", tt.chat, b, tt.want)
		}
	}
}

func TestHTTPErrorFails(t *testing.T) {
	srv := newSSEServer(t, http.StatusServiceUnavailable, 0)
	out := testClient(srv.URL+"/v1/completions", false).do(context.Background(), SampleRequest{Prompt: "p", OutputLen: 1})
	if out.Success || !strings.HasPrefix(out.Error, "Service Unavailable") {
		t.Errorf("success %v error %q", out.Success, out.Error)
	}
}

// prefillServer answers the prefill leg, not streamed, with
// kv_transfer_params params (raw JSON), and records what it got.
func prefillServer(t *testing.T, params string) *sseServer {
	s := &sseServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.bodies = append(s.bodies, b)
		s.headers = append(s.headers, r.Header.Clone())
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"cmpl-x","choices":[{"text":"a"}],"kv_transfer_params":`+params+`}`)
	}))
	t.Cleanup(s.Close)
	return s
}

func TestPDLegs(t *testing.T) {
	const params = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":5600,"tp_size":1}`
	tests := []struct {
		name       string
		chat       bool
		params     string
		wantDecode map[string]any // members the decode leg's body must have
	}{
		{"completions", false, params, map[string]any{"kv_transfer_params": mustMap(params), "stream": true, "max_tokens": 7.0}},
		{"chat", true, params, map[string]any{"kv_transfer_params": mustMap(params), "max_completion_tokens": 7.0}},
		{"no params from the prefill: the decode leg goes as it was", false, "null", map[string]any{"kv_transfer_params": nil}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pre := prefillServer(t, tt.params)
			dec := newSSEServer(t, http.StatusOK, 0,
				`data: {"choices":[{"text":"a","delta":{"content":"a"}}]}`+"\n\n",
				`data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}`+"\n\n")
			endpoint := "/v1/completions"
			if tt.chat {
				endpoint = "/v1/chat/completions"
			}
			c := testClient(dec.URL+endpoint, tt.chat)
			c.prefillURL = pre.URL + endpoint
			out := c.do(context.Background(), SampleRequest{Prompt: "hi you", PromptLen: 2, OutputLen: 7, RequestID: "bench-ab-3"})
			if !out.Success {
				t.Fatalf("failed: %s", out.Error)
			}

			pbody, phdr := pre.request(0)
			var p map[string]any
			if err := json.Unmarshal(pbody, &p); err != nil {
				t.Fatal(err)
			}
			wantKV := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
			if !jsonEqual(p["kv_transfer_params"], wantKV) || p["stream"] != false || p["max_tokens"] != 1.0 {
				t.Errorf("prefill body %s", pbody)
			}
			if _, ok := p["stream_options"]; ok {
				t.Errorf("prefill body has stream_options: %s", pbody)
			}
			if tt.chat && p["max_completion_tokens"] != 1.0 {
				t.Errorf("chat prefill body: max_completion_tokens not 1: %s", pbody)
			}
			if !tt.chat {
				if _, ok := p["max_completion_tokens"]; ok {
					t.Errorf("completions prefill body got max_completion_tokens: %s", pbody)
				}
			}

			dbody, dhdr := dec.request(0)
			var d map[string]any
			if err := json.Unmarshal(dbody, &d); err != nil {
				t.Fatal(err)
			}
			for k, v := range tt.wantDecode {
				if !jsonEqual(d[k], v) {
					t.Errorf("decode body %s = %v, want %v", k, d[k], v)
				}
			}
			if d["stream"] != true || d["stream_options"] == nil {
				t.Errorf("decode body is not the original request: %s", dbody)
			}
			if phdr.Get("X-Request-Id") != "bench-ab-3" || dhdr.Get("X-Request-Id") != "bench-ab-3" {
				t.Errorf("request ids: prefill %q decode %q", phdr.Get("X-Request-Id"), dhdr.Get("X-Request-Id"))
			}
			if phdr.Get("Authorization") != "Bearer sk-test" {
				t.Errorf("prefill leg has no Authorization")
			}
		})
	}
}

func TestPDPrefillFailure(t *testing.T) {
	pre := newSSEServer(t, http.StatusBadRequest, 0)
	dec := newSSEServer(t, http.StatusOK, 0)
	c := testClient(dec.URL+"/v1/completions", false)
	c.prefillURL = pre.URL + "/v1/completions"
	out := c.do(context.Background(), SampleRequest{Prompt: "p", OutputLen: 1})
	if out.Success || !strings.HasPrefix(out.Error, "prefill: Bad Request") {
		t.Errorf("success %v error %q", out.Success, out.Error)
	}
	if b, _ := dec.request(0); b != nil {
		t.Errorf("the decode leg was sent after a failed prefill")
	}
}

func mustMap(s string) map[string]any {
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		panic(err)
	}
	return m
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}
