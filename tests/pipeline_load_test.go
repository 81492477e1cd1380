package tests

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// TestPipelineUnderLoad runs a few hundred concurrent requests, chat and
// completions, streamed and not, through the gateway, JetStream and the
// workers, against two prefill and two decode engines in protocol v1, where
// a request whose legs carry different X-Request-Ids kills the decode
// engine. Every answer must be what a plain engine says for the prompt,
// and the engines' counters must show a clean handshake for every request.
// It runs with the replies over NATS, and in memory as in pdq up.
func TestPipelineUnderLoad(t *testing.T) {
	t.Run("over NATS", func(t *testing.T) { testPipelineUnderLoad(t, false) })
	t.Run("in process", func(t *testing.T) { testPipelineUnderLoad(t, true) })
}

func testPipelineUnderLoad(t *testing.T, inProcess bool) {
	cfg := simtest.FastConfig()
	cfg.Protocol = simconfig.ProtocolV1
	cfg.ITL = time.Millisecond
	cfg.PrefillOverhead = 2 * time.Millisecond
	p := startPipeline(t, pipelineOptions{prefill: 2, decode: 2, sim: cfg, local: inProcess})
	ref := simtest.Start(t, cfg) // a plain engine: the expected answers

	var prompts []string
	for i := range 12 {
		prompts = append(prompts, fmt.Sprintf("Request %d: explain in a few words why prefill and decode run on different GPUs, and what NIXL moves between them.", i))
	}
	short := []string{"hi", "ok?", "yes"} // below the P/D threshold: decode-only
	prompts = append(prompts, short...)

	type request struct {
		i         int
		endpoint  openai.Endpoint
		stream    bool
		usage     bool
		prompt    string
		maxTokens int
		id        string
	}
	const n = 300
	reqs := make([]request, n)
	for i := range reqs {
		r := request{i: i, endpoint: openai.Chat, prompt: prompts[i%len(prompts)], maxTokens: 3 + i%11}
		if i%2 == 1 {
			r.endpoint = openai.Completions
		}
		r.stream = i%4 >= 2
		r.usage = r.stream && i%8 >= 4
		if i%3 == 0 {
			r.id = fmt.Sprintf("load-%d", i)
		}
		reqs[i] = r
	}
	build := func(r request) body {
		extra := body{"max_tokens": r.maxTokens, "ignore_eos": true}
		if r.stream {
			extra["stream"] = true
			if r.usage {
				extra["stream_options"] = map[string]any{"include_usage": true}
			}
		}
		if r.endpoint == openai.Chat {
			return chatBody(model, r.prompt, extra)
		}
		return completionBody(model, r.prompt, extra)
	}

	// The expected answer of each distinct request, from the plain engine.
	expected := map[string]result{}
	for _, r := range reqs {
		plain := request{endpoint: r.endpoint, prompt: r.prompt, maxTokens: r.maxTokens}
		key := fmt.Sprint(plain)
		if _, ok := expected[key]; !ok {
			expected[key], _ = parseResponse(t, post(t, ref.URL+r.endpoint.Path(), "", build(plain)))
		}
	}

	var wg sync.WaitGroup
	errs := make(chan string, n)
	for _, r := range reqs {
		wg.Go(func() {
			url := p.url + r.endpoint.Path()
			want := expected[fmt.Sprint(request{endpoint: r.endpoint, prompt: r.prompt, maxTokens: r.maxTokens})]
			var got result
			var header http.Header
			if r.stream {
				s := postStream(t, url, r.id, build(r))
				if s.err != nil || s.status != http.StatusOK || !s.done {
					errs <- fmt.Sprintf("request %d: stream status %d, done %v, err %v, events %q", r.i, s.status, s.done, s.err, s.events)
					return
				}
				var err error
				if got, err = checkStream(s, r.endpoint, r.usage); err != nil {
					errs <- fmt.Sprintf("request %d: %v", r.i, err)
					return
				}
				header = s.header
			} else {
				resp, err := tryPost(url, r.id, build(r))
				if err == nil {
					got, _, err = checkResponse(resp)
				}
				if err != nil {
					errs <- fmt.Sprintf("request %d: %v", r.i, err)
					return
				}
				header = resp.header
			}
			id := header.Get("X-Request-Id")
			if r.id != "" && id != r.id || r.id == "" && len(id) != 36 {
				errs <- fmt.Sprintf("request %d: X-Request-Id %q, sent %q", r.i, id, r.id)
			}
			if got.id != r.endpoint.IDPrefix()+id {
				errs <- fmt.Sprintf("request %d: response id %q does not carry the request id %q", r.i, got.id, id)
			}
			if got.text != want.text || got.finish != openai.FinishLength || tokenizer.CountTokens(got.text) != r.maxTokens {
				errs <- fmt.Sprintf("request %d: text %q (finish %q), want %q", r.i, got.text, got.finish, want.text)
			}
			if (!r.stream || r.usage) && got.usage != want.usage {
				errs <- fmt.Sprintf("request %d: usage %+v, want %+v", r.i, got.usage, want.usage)
			}
		})
	}
	wg.Wait()
	close(errs)
	failures := 0
	for e := range errs {
		if failures++; failures <= 10 {
			t.Error(e)
		}
	}
	if failures > 10 {
		t.Errorf("... and %d more failures", failures-10)
	}

	nShort := 0
	for _, r := range reqs {
		for _, s := range short {
			if r.prompt == s {
				nShort++
			}
		}
	}
	var prefills, reads, local int64
	for i, e := range p.prefill {
		s := e.Stats(t)
		prefills += s.Prefills
		if s.Prefills == 0 || s.BlocksHeld != 0 || s.KVServed != s.Prefills || s.EngineDead {
			t.Errorf("prefill engine %d: %+v; want work, every prefill read once, nothing held", i, s)
		}
	}
	for i, e := range p.decode {
		s := e.Stats(t)
		reads += s.KVReads
		local += s.Local
		if s.KVReads == 0 || s.KVReadFailures != 0 || s.Recomputes != 0 || s.KVMismatches != 0 || s.EngineDead || s.Aborts != 0 {
			t.Errorf("decode engine %d: %+v; want reads and no failures", i, s)
		}
	}
	if prefills != int64(n-nShort) || reads != prefills || local != int64(nShort) {
		t.Errorf("%d prefills, %d KV reads, %d decode-only; want %d, %d, %d", prefills, reads, local, n-nShort, n-nShort, nShort)
	}
	t.Logf("%d requests: %d P/D, %d decode-only", n, prefills, local)
}

// TestPipelineModels checks /v1/models, /health and /ready.
func TestPipelineModels(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	r := get(t, p.url+"/v1/models")
	r.wantStatus(t, http.StatusOK)
	var list openai.ModelList
	r.decode(t, &list)
	if len(list.Data) != 1 || list.Data[0].ID != model || list.Object != "list" {
		t.Errorf("models = %s", r.body)
	}
	get(t, p.url+"/health").wantStatus(t, http.StatusOK)
	get(t, p.url+"/ready").wantStatus(t, http.StatusOK)
	if !strings.Contains(dispatcher.PoolName(model), model) {
		t.Errorf("pool of %q is %q", model, dispatcher.PoolName(model))
	}
}
