// Command pdproxy is a plain prefill/decode reverse proxy: the HTTP work
// that any router of the two legs does, and nothing else. No queue, no
// records, no retries: a request's prefill leg, then its decode leg,
// relayed to the client as the engine sends it. `make bench` runs it
// beside pdq up, so that pdq's overhead is seen against a router's, not
// only against the floor (a client that drives both legs itself).
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
//	pdproxy -addr 127.0.0.1:8000 -prefill http://127.0.0.1:8100 -decode http://127.0.0.1:8200
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
	"net/http"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8000", "listen address")
	prefill := flag.String("prefill", "", "prefill engine URL")
	decode := flag.String("decode", "", "decode engine URL")
	flag.Parse()
	if *prefill == "" || *decode == "" {
		fmt.Fprintln(os.Stderr, "pdproxy: -prefill and -decode are required")
		os.Exit(2)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	if err := run(ctx, *addr, newHandler(*prefill, *decode)); err != nil {
		fmt.Fprintln(os.Stderr, "pdproxy:", err)
		os.Exit(1)
	}
}

// run serves h on addr until ctx ends.
func run(ctx context.Context, addr string, h http.Handler) error {
	srv := &http.Server{Addr: addr, Handler: h}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// newHandler serves the OpenAI generation endpoints through the engines
// at the prefill and decode URLs.
func newHandler(prefill, decode string) http.Handler {
	p := &proxy{prefill: prefill, decode: decode, client: &http.Client{Transport: &http.Transport{
		MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024,
	}}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", p.serve)
	mux.HandleFunc("POST /v1/completions", p.serve)
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	return mux
}

type proxy struct {
	prefill, decode string
	client          *http.Client
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
	resp, err := p.post(r.Context(), p.prefill, r.URL.Path, id, pre)
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
	resp, err = p.post(r.Context(), p.decode, r.URL.Path, id, req)
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
