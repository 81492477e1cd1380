package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// startUp runs `pdq up` with simulated engines on free loopback ports and
// returns the process and the gateway's base URL, once it serves a P/D
// request.
func startUp(t *testing.T, env ...string) (*process, string) {
	t.Helper()
	env = append([]string{"PDQ_DATA_DIR=" + t.TempDir(), "PDQ_HTTP_ADDR=127.0.0.1:0"}, env...)
	up := startPDQ(t, env, "up")
	rec := up.waitLog(t, "gateway listening")
	url := "http://" + rec["addr"].(string)
	waitServing(t, url)
	up.waitStdout(t, "pdq is up")
	return up, url
}

// waitServing polls until the gateway serves a request that needs both
// pools, so a test does not race the workers' registration.
func waitServing(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		// Served through prefill: until the gateway sees a prefill worker,
		// long prompts go decode-only (the fallback).
		id := fmt.Sprintf("ready-%d-%d", time.Now().UnixNano(), i)
		r, err := tryPost(url+"/v1/completions", id, completionBody(model, longPrompt, body{"max_tokens": 1}))
		if err == nil && r.status == http.StatusOK {
			var rec dispatcher.Record
			if g, err := tryDo(http.MethodGet, url+"/v1/requests/"+id, nil, nil); err == nil && json.Unmarshal(g.body, &rec) == nil && !rec.DecodeOnly {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pdq up does not serve after 20s: %v %d %s", err, r.status, r.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestUpWithJoiningDecodeWorker runs `pdq up` with a NATS listener and a
// second process, `pdq decode`, that joins it with its own engine: jobs
// must reach the new worker, and its engine must read the KV blocks of
// pdq up's prefill engine.
func TestUpWithJoiningDecodeWorker(t *testing.T) {
	up, url := startUp(t, "PDQ_NATS_LISTEN=127.0.0.1:0", "PDQ_ENGINE_SLOTS=1")
	natsURL, _ := up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
	if natsURL == "" {
		t.Fatalf("pdq up did not report a NATS client URL:\n%s", up.output())
	}
	cfg := simtest.FastConfig()
	cfg.ITL = 2 * time.Millisecond
	engine := simtest.Start(t, cfg)
	dec := startPDQ(t, []string{"PDQ_NATS_URL=" + natsURL, "PDQ_ENGINE_URL=" + engine.URL, "PDQ_ENGINE_SLOTS=8"}, "decode")
	dec.waitLog(t, "stage worker pulling")

	const n = 24
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			b := chatBody(model, fmt.Sprintf("%s (%d)", longPrompt, i), body{"max_tokens": 30, "ignore_eos": true, "stream": true})
			s := postStream(t, url+"/v1/chat/completions", "", b)
			res, err := checkStream(s, openai.Chat, false)
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			if got := len(res.text); got == 0 {
				t.Errorf("request %d: empty text", i)
			}
		})
	}
	wg.Wait()
	s := engine.Stats(t)
	if s.Decodes == 0 || s.KVReads != s.Decodes || s.KVReadFailures != 0 || s.Local != 0 {
		t.Errorf("the joining worker's engine: %+v; want P/D decodes with one KV read each", s)
	}
	t.Logf("%d of %d requests decoded by the joining worker", s.Decodes, n)
}

// TestSeparateProcesses runs each component as its own process, joined
// through the NATS that `pdq up` listens on: a second gateway, a prefill
// and a decode worker, each worker with its own engine. Requests through
// the second gateway succeed, and the separate workers' engines do work.
func TestSeparateProcesses(t *testing.T) {
	up, _ := startUp(t, "PDQ_NATS_LISTEN=127.0.0.1:0", "PDQ_ENGINE_SLOTS=1")
	natsURL, _ := up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
	cfg := simtest.FastConfig()
	cfg.ITL = 2 * time.Millisecond
	cfg.PrefillOverhead = 20 * time.Millisecond
	pe, de := simtest.Start(t, cfg), simtest.Start(t, cfg)
	nats := "PDQ_NATS_URL=" + natsURL
	startPDQ(t, []string{nats, "PDQ_ENGINE_URL=" + pe.URL}, "prefill").waitLog(t, "stage worker pulling")
	startPDQ(t, []string{nats, "PDQ_ENGINE_URL=" + de.URL}, "decode").waitLog(t, "stage worker pulling")
	gw := startPDQ(t, []string{nats, "PDQ_HTTP_ADDR=127.0.0.1:0"}, "gateway")
	url := "http://" + gw.waitLog(t, "gateway listening")["addr"].(string)
	waitServing(t, url)

	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			b := completionBody(model, fmt.Sprintf("%s (%d)", longPrompt, i), body{"max_tokens": 10, "ignore_eos": true})
			r, err := tryPost(url+"/v1/completions", "", b)
			if err == nil {
				_, _, err = checkResponse(r)
			}
			if err != nil {
				t.Errorf("request %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	ps, ds := pe.Stats(t), de.Stats(t)
	if ps.Prefills == 0 || ds.Decodes == 0 || ds.KVReadFailures != 0 || ps.BlocksHeld != 0 {
		t.Errorf("separate engines: prefill %+v, decode %+v; want work on both and clean handshakes", ps, ds)
	}
}

// TestUpWithEngines runs `pdq up` against engines given in
// PDQ_PREFILL_ENGINES and PDQ_DECODE_ENGINES: one worker per URL, no
// simulated engines of its own.
func TestUpWithEngines(t *testing.T) {
	cfg := simtest.FastConfig()
	p1, p2, d1 := simtest.Start(t, cfg), simtest.Start(t, cfg), simtest.Start(t, cfg)
	up, url := startUp(t, "PDQ_PREFILL_ENGINES="+p1.URL+","+p2.URL, "PDQ_DECODE_ENGINES="+d1.URL, "PDQ_ENGINE_SLOTS=1")
	if out := up.output(); strings.Contains(out, "started a simulated") {
		t.Errorf("pdq up started simulated engines although engines were given")
	}
	banner := up.waitStdout(t, "curl")
	if !strings.Contains(banner, "pdq is up: OpenAI API at "+url+"/v1") || !strings.Contains(banner, "2 prefill, 1 decode") || !strings.Contains(banner, "curl -sN "+url) {
		t.Errorf("banner = %q", banner)
	}
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Go(func() {
			r, err := tryPost(url+"/v1/completions", "", completionBody(model, fmt.Sprintf("%s (%d)", longPrompt, i), body{"max_tokens": 3}))
			if err == nil {
				_, _, err = checkResponse(r)
			}
			if err != nil {
				t.Errorf("request %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	s1, s2, sd := p1.Stats(t), p2.Stats(t), d1.Stats(t)
	// The warm-up request of startUp counts too.
	if s1.Prefills+s2.Prefills != 13 || s1.Prefills == 0 || s2.Prefills == 0 || sd.KVReads != 13 {
		t.Errorf("prefill engines %d + %d, decode reads %d; want 13 spread over both, 13 reads", s1.Prefills, s2.Prefills, sd.KVReads)
	}
}

// TestUpConfigErrors checks that pdq up refuses half an engine list.
func TestUpConfigErrors(t *testing.T) {
	up := startPDQ(t, []string{"PDQ_DATA_DIR=" + t.TempDir(), "PDQ_HTTP_ADDR=127.0.0.1:0", "PDQ_PREFILL_ENGINES=http://127.0.0.1:1"}, "up")
	<-up.exited
	if up.err == nil || !strings.Contains(up.output(), "set both PDQ_PREFILL_ENGINES and PDQ_DECODE_ENGINES") {
		t.Errorf("exit %v, output %s", up.err, up.output())
	}
}

// TestUpRepliesInProcess checks that `pdq up` streams a reply from its own
// decode worker to its own gateway without a reply message through NATS
// (reply.LocalReplies), and the client gets the whole stream.
func TestUpRepliesInProcess(t *testing.T) {
	up, url := startUp(t, "PDQ_NATS_LISTEN=127.0.0.1:0")
	natsURL, _ := up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	const id = "in-process-1"
	sub, err := nc.SubscribeSync(dispatcher.ReplySubject("*", id))
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	s := postStream(t, url+"/v1/chat/completions", id, chatBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true}))
	res, err := checkStream(s, openai.Chat, false)
	if err != nil || res.text == "" || res.finish != "length" {
		t.Fatalf("stream: %+v, %v; want 16 tokens ending in length", res, err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if m, err := sub.NextMsg(100 * time.Millisecond); err == nil {
		t.Errorf("a reply message went through NATS: %v %q", m.Header, m.Data)
	}
}
