package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/tools/internal/enginemetrics"
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
	srv := serve(t, config{prefill: []string{prefill.URL}, decode: []string{decode.URL}, policy: roundRobin})

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

// serve runs the proxy with cfg until the test ends.
func serve(t *testing.T, cfg config) *httptest.Server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h, err := newHandler(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() { srv.Close(); cancel() })
	return srv
}

// batched is an engine of the seed profile (vLLM's scheduler model, with
// vLLM's metrics), its costs multiplied by scale, that runs at most seqs
// requests at once.
func batched(scale float64, seqs int) simconfig.Config {
	c := simtest.FastConfig()
	c.Profile, c.TimeScale, c.MaxNumSeqs = "seed", scale, seqs
	return c
}

// chat sends a chat request of a few hundred words through url and
// fails the test unless it succeeds.
func chat(t *testing.T, url string, i int) {
	t.Helper()
	body := fmt.Sprintf(`{"model":"pdq-sim","messages":[{"role":"user","content":"request %d %s"}],"max_tokens":3,"stream":true}`,
		i, strings.Repeat("word ", 200))
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") {
		t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
	}
}

// Round-robin cycles each leg's engines, as vLLM's toy proxy does: six
// requests, two of each of three prefill engines, three of each of two
// decode engines.
func TestRoundRobin(t *testing.T) {
	cfg := batched(0.01, 256)
	prefill := []*simtest.Engine{simtest.Start(t, cfg), simtest.Start(t, cfg), simtest.Start(t, cfg)}
	decode := []*simtest.Engine{simtest.Start(t, cfg), simtest.Start(t, cfg)}
	srv := serve(t, config{prefill: urls(prefill), decode: urls(decode), policy: roundRobin})
	for i := range 6 {
		chat(t, srv.URL, i)
	}
	for i, e := range prefill {
		if s := e.Stats(t); s.Prefills != 2 {
			t.Errorf("prefill engine %d ran %d prefills, want 2", i, s.Prefills)
		}
	}
	for i, e := range decode {
		if s := e.Stats(t); s.Decodes != 3 || s.KVReads != 3 {
			t.Errorf("decode engine %d ran %d decodes (%d KV reads), want 3", i, s.Decodes, s.KVReads)
		}
	}
}

// Least-loaded sends each leg to the engine with the fewest waiting
// requests, then the fewest running, as the engines' /metrics say: the
// prefill leg avoids an engine with requests waiting, the decode leg one
// with a request running; and a burst between two readings is spread.
func TestLeastLoaded(t *testing.T) {
	// Busy engines at the seed profile's own speed, where a 400-token
	// answer takes seconds; one request at a time on the busy prefill
	// engine, so that two more wait.
	busyPrefill, busyDecode := simtest.Start(t, batched(1, 1)), simtest.Start(t, batched(1, 256))
	cfg := batched(0.01, 256)
	idlePrefill, idleDecode := simtest.Start(t, cfg), simtest.Start(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	long := func(e *simtest.Engine) {
		wg.Go(func() {
			body := `{"model":"pdq-sim","prompt":"keep this engine busy","max_tokens":400,"ignore_eos":true}`
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.URL+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	for range 3 {
		long(busyPrefill)
	}
	long(busyDecode)
	waitMetric(t, busyPrefill.URL, "vllm:num_requests_waiting", 2)
	waitMetric(t, busyDecode.URL, "vllm:num_requests_running", 1)

	const poll = 20 * time.Millisecond
	srv := serve(t, config{prefill: []string{busyPrefill.URL, idlePrefill.URL}, decode: []string{busyDecode.URL, idleDecode.URL},
		policy: leastLoaded, poll: poll})
	time.Sleep(5 * poll) // a reading of each engine
	chat(t, srv.URL, 0)
	if p, d := busyPrefill.Stats(t), busyDecode.Stats(t); p.Prefills != 0 || d.Decodes != 0 {
		t.Errorf("the busy engines got %d prefills and %d decodes, want none", p.Prefills, d.Decodes)
	}
	if p, d := idlePrefill.Stats(t), idleDecode.Stats(t); p.Prefills != 1 || d.Decodes != 1 {
		t.Errorf("the idle engines got %d prefills and %d decodes, want 1 each", p.Prefills, d.Decodes)
	}

	// Two idle engines a leg and a burst of four at once: between two
	// readings, what the proxy sent counts as running there, so each
	// engine gets two.
	a, b := simtest.Start(t, cfg), simtest.Start(t, cfg)
	c, d := simtest.Start(t, cfg), simtest.Start(t, cfg)
	burst := serve(t, config{prefill: []string{a.URL, b.URL}, decode: []string{c.URL, d.URL}, policy: leastLoaded, poll: time.Hour})
	var sent sync.WaitGroup
	for i := range 4 {
		sent.Go(func() { chat(t, burst.URL, 10+i) })
	}
	sent.Wait()
	for i, e := range []*simtest.Engine{a, b} {
		if s := e.Stats(t); s.Prefills != 2 {
			t.Errorf("burst: prefill engine %d got %d prefills, want 2", i, s.Prefills)
		}
	}
	for i, e := range []*simtest.Engine{c, d} {
		if s := e.Stats(t); s.Decodes != 2 {
			t.Errorf("burst: decode engine %d got %d decodes, want 2", i, s.Decodes)
		}
	}
}

func urls(es []*simtest.Engine) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.URL)
	}
	return out
}

// waitMetric waits until the engine at url reports at least want of the
// metric name.
func waitMetric(t *testing.T, url, name string, want float64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		m, err := enginemetrics.Fetch(context.Background(), http.DefaultClient, url)
		if err != nil {
			t.Fatal(err)
		}
		if m[name] >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s is %v, want %v", url, name, m[name], want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestNewHandlerRefuses(t *testing.T) {
	for _, cfg := range []config{
		{decode: []string{"http://d"}, policy: roundRobin},
		{prefill: []string{"http://p"}, policy: roundRobin},
		{prefill: []string{"http://p"}, decode: []string{"http://d"}, policy: "random"},
		{prefill: []string{"http://p"}, decode: []string{"http://d"}, policy: leastLoaded},
	} {
		if _, err := newHandler(context.Background(), cfg); err == nil {
			t.Errorf("newHandler(%+v) accepted it", cfg)
		}
	}
	if got := splitURLs(" http://a/, ,http://b"); len(got) != 2 || got[0] != "http://a" || got[1] != "http://b" {
		t.Errorf("splitURLs = %q", got)
	}
}
