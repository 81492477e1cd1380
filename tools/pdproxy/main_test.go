package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// The proxy is a reference only if its handshake is right: pdq sim
// engines count a decode that loaded the prefill's KV, and one that did
// not (a recompute, or a local run); a v1 decode engine dies of legs with
// two X-Request-Ids.
func TestProxyHandshake(t *testing.T) {
	for _, protocol := range []simconfig.Protocol{simconfig.ProtocolV1, simconfig.ProtocolV2} {
		t.Run(string(protocol), func(t *testing.T) { testHandshake(t, protocol) })
	}
}

func testHandshake(t *testing.T, protocol simconfig.Protocol) {
	cfg := simtest.FastConfig()
	cfg.Protocol = protocol
	prefill, decode := simtest.Start(t, cfg), simtest.Start(t, cfg)
	srv := httptest.NewServer(newHandler(prefill.URL, decode.URL))
	defer srv.Close()

	for _, tc := range []struct{ path, body, last string }{
		{"/v1/chat/completions", `{"model":"pdq-sim","messages":[{"role":"user","content":"hello there"}],` +
			`"max_completion_tokens":5,"min_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`, "data: [DONE]"},
		{"/v1/completions", `{"model":"pdq-sim","prompt":"hello there","max_tokens":3}`, `"kv_transfer_params":null}`},
	} {
		resp, err := http.Post(srv.URL+tc.path, "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.HasSuffix(strings.TrimSpace(string(b)), tc.last) {
			t.Errorf("%s: %d %s", tc.path, resp.StatusCode, b)
		}
	}
	p, d := prefill.Stats(t), decode.Stats(t)
	if p.Prefills != 2 || p.KVServed != 2 || d.Decodes != 2 || d.KVReads != 2 || d.Recomputes != 0 || d.KVMismatches != 0 || d.Local != 0 {
		t.Errorf("engines: prefill %+v, decode %+v; want 2 prefills whose KV the 2 decodes read", p, d)
	}

	// An engine's refusal reaches the client as the engine gave it.
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"nope","prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("unknown model: %d, want 404", resp.StatusCode)
	}
}
