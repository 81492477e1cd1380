// Command pdproxy is a plain prefill/decode reverse proxy: the HTTP work
// that any router of the two legs does, and nothing else. No queue, no
// records, no retries: a request's prefill leg, then its decode leg,
// relayed to the client as the engine sends it. `make bench` runs it
// beside pdq up, so that pdq's overhead is seen against a router's, not
// only against the floor (a client that drives both legs itself); `make
// bench-cluster` runs it in front of several engines a leg, with each
// policy, beside pdq's scheduling.
//
// The legs are those of vLLM's toy_proxy_server.py (and llm-d's NIXL
// connector): the prefill body is the request with kv_transfer_params
// {do_remote_decode:true}, stream false, max_tokens (and
// max_completion_tokens, when set) 1, no stream_options and no min_tokens;
// the decode body is the request with the kv_transfer_params the prefill
// returned; both legs carry the same X-Request-Id. It decodes and encodes
// the request's top level with encoding/json, as most proxies do (pdq
// splices the body instead). A prefill answer without kv_transfer_params
// is a 502, as in vLLM's disagg_proxy_demo.py (toy_proxy_server.py would
// send the decode leg on without them, to recompute the prompt).
//
// -prefill and -decode take comma-separated engine URLs; each leg picks
// its engine by -policy:
//
//   - round-robin: the next engine of the leg's list, in turn, as
//     toy_proxy_server.py cycles its prefill and its decode clients;
//   - least-loaded: the engine with the fewest vllm:num_requests_waiting,
//     ties broken by the fewest vllm:num_requests_running (then in turn),
//     as a load-aware router reads them from each engine's /metrics, every
//     -poll (100 ms). The requests the proxy sent an engine since its last
//     reading count there too, as waiting where requests were waiting and
//     as running where none were (the engine had room), so that a burst
//     between two readings is not sent to one engine.
//
// For example:
//
//	pdproxy -addr 127.0.0.1:8000 -prefill http://127.0.0.1:8100 -decode http://127.0.0.1:8200
//	pdproxy -policy least-loaded -prefill http://p1:8100,http://p2:8100 -decode http://d1:8200,http://d2:8200
//
// It prints "pdproxy listening on ADDR" when it serves (with -addr
// 127.0.0.1:0, on a free port).
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/pdq-dev/pdq/tools/internal/enginemetrics"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8000", "listen address")
	prefill := flag.String("prefill", "", "prefill engine URLs, comma-separated")
	decode := flag.String("decode", "", "decode engine URLs, comma-separated")
	policy := flag.String("policy", roundRobin, "how each leg picks its engine: round-robin or least-loaded")
	poll := flag.Duration("poll", 100*time.Millisecond, "least-loaded: how often each engine's /metrics is read")
	flag.Parse()
	cfg := config{prefill: splitURLs(*prefill), decode: splitURLs(*decode), policy: *policy, poll: *poll}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	h, err := newHandler(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdproxy:", err)
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdproxy:", err)
		os.Exit(1)
	}
	fmt.Printf("pdproxy listening on %s (policy %s, %d prefill, %d decode engines)\n", ln.Addr(), cfg.policy, len(cfg.prefill), len(cfg.decode))
	if err := run(ctx, ln, h); err != nil {
		fmt.Fprintln(os.Stderr, "pdproxy:", err)
		os.Exit(1)
	}
}

// splitURLs splits a comma-separated list, without empty items or
// trailing slashes.
func splitURLs(s string) []string {
	var out []string
	for _, u := range strings.Split(s, ",") {
		if u = strings.TrimSuffix(strings.TrimSpace(u), "/"); u != "" {
			out = append(out, u)
		}
	}
	return out
}

// run serves h on ln until ctx ends.
func run(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// The policies.
const (
	roundRobin  = "round-robin"
	leastLoaded = "least-loaded"
)

// config is the proxy's engines and how it picks them.
type config struct {
	prefill, decode []string
	policy          string
	// poll is how often least-loaded reads each engine's /metrics.
	poll time.Duration
}

// newHandler serves the OpenAI generation endpoints through the engines
// of cfg; least-loaded reads their /metrics until ctx ends.
func newHandler(ctx context.Context, cfg config) (http.Handler, error) {
	if len(cfg.prefill) == 0 || len(cfg.decode) == 0 {
		return nil, errors.New("-prefill and -decode are required")
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024}}
	p := &proxy{client: client}
	switch cfg.policy {
	case roundRobin:
		p.prefill, p.decode = &cycle{urls: cfg.prefill}, &cycle{urls: cfg.decode}
	case leastLoaded:
		if cfg.poll <= 0 {
			return nil, fmt.Errorf("-poll must be positive, got %v", cfg.poll)
		}
		poller := &http.Client{Timeout: time.Second}
		p.prefill = newLeast(ctx, poller, cfg.prefill, cfg.poll)
		p.decode = newLeast(ctx, poller, cfg.decode, cfg.poll)
	default:
		return nil, fmt.Errorf("-policy must be %s or %s, got %q", roundRobin, leastLoaded, cfg.policy)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", p.serve)
	mux.HandleFunc("POST /v1/completions", p.serve)
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	return mux, nil
}

type proxy struct {
	prefill, decode picker
	client          *http.Client
}

// picker chooses the engine of a leg.
type picker interface {
	pick() string
}

// cycle is round-robin: each engine in turn, as toy_proxy_server.py's
// get_next_client.
type cycle struct {
	urls []string
	next atomic.Uint64
}

func (c *cycle) pick() string {
	return c.urls[(c.next.Add(1)-1)%uint64(len(c.urls))]
}

// least is least-loaded: the engine with the fewest waiting requests,
// then the fewest running, by their last /metrics reading.
type least struct {
	engines []*engineLoad
	next    atomic.Uint64 // where the scan for ties starts
	mu      sync.Mutex    // one pick at a time, so that sent counts are seen
	// engines is set by newLeast; each engine's poller goroutine writes
	// its reading under the engine's own lock, and a pick, holding mu,
	// reads every engine's under theirs. next is only moved by a pick.
}

// engineLoad is an engine's last reading, and what the proxy sent it
// since.
type engineLoad struct {
	url string
	// mu guards the fields below: the poller writes them, picks read
	// them and count what they send.
	mu               sync.Mutex
	waiting, running float64
	sent             int // requests sent since the reading
}

func newLeast(ctx context.Context, client *http.Client, urls []string, poll time.Duration) *least {
	l := &least{}
	var first sync.WaitGroup
	for _, u := range urls {
		e := &engineLoad{url: u}
		l.engines = append(l.engines, e)
		first.Go(func() { e.read(ctx, client) })
	}
	// The first readings are in before the proxy serves: one that came in
	// the middle of its first requests would forget those it had sent.
	first.Wait()
	for _, e := range l.engines {
		go e.watch(ctx, client, poll)
	}
	return l
}

// watch reads the engine's load every poll, after the first reading,
// until ctx ends.
func (e *engineLoad) watch(ctx context.Context, client *http.Client, poll time.Duration) {
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		e.read(ctx, client)
	}
}

// read takes one reading of the engine's load. A reading that fails
// leaves the last one in place.
func (e *engineLoad) read(ctx context.Context, client *http.Client) {
	m, err := enginemetrics.Fetch(ctx, client, e.url)
	if err != nil {
		return
	}
	e.mu.Lock()
	e.waiting, e.running, e.sent = m[enginemetrics.Waiting], m[enginemetrics.Running], 0
	e.mu.Unlock()
}

// load is the engine's waiting and running requests as the proxy
// reckons them: its last reading, with the requests sent since, which
// wait where requests were waiting and run where none were.
func (e *engineLoad) load() (waiting, running float64) {
	if e.waiting > 0 {
		return e.waiting + float64(e.sent), e.running
	}
	return 0, e.running + float64(e.sent)
}

func (l *least) pick() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.engines)
	start := int(l.next.Add(1)-1) % n
	var best *engineLoad
	var bestWaiting, bestRunning float64
	for k := range n {
		e := l.engines[(start+k)%n]
		e.mu.Lock()
		w, r := e.load()
		e.mu.Unlock()
		if best == nil || w < bestWaiting || w == bestWaiting && r < bestRunning {
			best, bestWaiting, bestRunning = e, w, r
		}
	}
	best.mu.Lock()
	best.sent++
	best.mu.Unlock()
	return best.url
}

// prefillParams is what a router sends the prefill engine
// (toy_proxy_server.py).
const prefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

func (p *proxy) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req map[string]json.RawMessage
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var raw [16]byte
	rand.Read(raw[:])
	id := hex.EncodeToString(raw[:])

	pre := make(map[string]json.RawMessage, len(req)+3)
	for k, v := range req {
		pre[k] = v
	}
	pre["kv_transfer_params"] = json.RawMessage(prefillParams)
	pre["stream"] = json.RawMessage("false")
	pre["max_tokens"] = json.RawMessage("1")
	if _, ok := pre["max_completion_tokens"]; ok {
		pre["max_completion_tokens"] = json.RawMessage("1")
	}
	delete(pre, "stream_options")
	delete(pre, "min_tokens")
	delete(pre, "min_completion_tokens")
	resp, err := p.post(r.Context(), p.prefill.pick(), r.URL.Path, id, pre)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	answer, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if resp.StatusCode != http.StatusOK {
		relay(w, resp, bytes.NewReader(answer))
		return
	}
	var kv struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(answer, &kv); err != nil || len(kv.Params) == 0 {
		http.Error(w, "the prefill engine returned no kv_transfer_params", http.StatusBadGateway)
		return
	}
	req["kv_transfer_params"] = kv.Params
	resp, err = p.post(r.Context(), p.decode.pick(), r.URL.Path, id, req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	relay(w, resp, resp.Body)
}

func (p *proxy) post(ctx context.Context, engine, path, id string, body map[string]json.RawMessage) (*http.Response, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, engine+path, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	return p.client.Do(req)
}

// relay copies an engine's answer to the client as it comes, flushing
// what each read brought.
func relay(w http.ResponseWriter, resp *http.Response, body io.Reader) {
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			rc.Flush()
		}
		if err != nil {
			return
		}
	}
}
