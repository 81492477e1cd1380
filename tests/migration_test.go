package tests

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// droppingCluster is a cluster whose decode engine drops every stream
// halfway, with one migration allowed. The breaker would open on these
// failures and probe the engine with requests of its own, which the tests
// count: it is not their subject.
func droppingCluster(t *testing.T) *cluster {
	c := startCluster(t, clusterOptions{env: []string{"PDQ_MIGRATION_LIMIT=1", "PDQ_BREAKER_FAILURES=100"}})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	setFault(t, c.decode, `{"rate":1,"kind":"drop"}`)
	return c
}

// TestMigrationBounds drops every decode stream halfway: a request that
// cannot be continued from its text (echo) ends with an in-stream error at
// once, and one that can moves once (PDQ_MIGRATION_LIMIT=1), to the same
// dropping engine here, and then ends with an in-stream error, its text
// grown by what the continuation said first.
func TestMigrationBounds(t *testing.T) {
	c := droppingCluster(t)
	for _, tc := range []struct {
		name         string
		extra        body
		calls, words int
	}{
		{"echo cannot be continued", body{"echo": true}, 1, 8},
		{"one move then the limit", body{}, 2, 8 + 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := c.decode.Stats(t)
			b := completionBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true})
			for k, v := range tc.extra {
				b[k] = v
			}
			s := postStream(t, c.url+"/v1/completions", "mig-"+strings.NewReplacer(" ", "-", ",", "").Replace(tc.name), b)
			sum := summarize(s)
			last := ""
			if len(s.events) > 0 {
				last = string(s.events[len(s.events)-1])
			}
			if s.status != 200 || !s.done || !strings.Contains(last, `"error"`) {
				t.Fatalf("status %d, done %v, last event %s; want an in-stream error, then [DONE]", s.status, s.done, last)
			}
			if n := tokenizer.CountTokens(sum.text); n != tc.words {
				t.Errorf("the client got %d words (%q), want %d", n, sum.text, tc.words)
			}
			after := c.decode.WaitStats(t, 10*time.Second, "the decode engine idle", func(s sim.Stats) bool { return s.Running == 0 })
			if n := after.Requests - before.Requests; n != int64(tc.calls) {
				t.Errorf("%d decode calls, want %d", n, tc.calls)
			}
		})
	}
}

// TestMigrationAvoidsBrokenEngine runs two decode workers, one in front of
// an engine that drops every stream halfway. A request decoded there moves
// once (PDQ_MIGRATION_LIMIT=1), and its continuation must go to the other
// engine, not back to the one that broke: back there it would break again,
// past the limit, and end with an in-stream error. Dynamo keeps a failed
// worker out of a migration's choice for a few seconds; pdq's workers pull,
// so the one whose engine broke hands the continuation on.
func TestMigrationAvoidsBrokenEngine(t *testing.T) {
	// The breaker would take the dropping engine out after a few
	// failures and hide what is tested here.
	c := startCluster(t, clusterOptions{env: []string{"PDQ_MIGRATION_LIMIT=1", "PDQ_BREAKER_FAILURES=100"}})
	_, healthy := startSimProcess(t)
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 4)
	c.worker(dispatcher.StageDecode, 4, "PDQ_ENGINE_URL="+healthy.URL)
	c.ready()
	setFault(t, c.decode, `{"rate":1,"kind":"drop"}`)
	const n = 16
	broken, good := c.decode.Stats(t), healthy.Stats(t)
	// Four at a time, so that the workers' pulls come in every order.
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			b := completionBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true})
			s := postStream(t, c.url+"/v1/completions", fmt.Sprintf("avoid-%d", i), b)
			sum := summarize(s)
			if !sum.whole || tokenizer.CountTokens(sum.text) != 16 {
				t.Errorf("request %d: status %d, whole %v, %d words (%q); want the whole answer of 16",
					i, s.status, sum.whole, tokenizer.CountTokens(sum.text), sum.text)
			}
		})
	}
	wg.Wait()
	idle := func(s sim.Stats) bool { return s.Running == 0 }
	b := c.decode.WaitStats(t, 10*time.Second, "the dropping engine idle", idle).Requests - broken.Requests
	g := healthy.WaitStats(t, 10*time.Second, "the healthy engine idle", idle).Requests - good.Requests
	t.Logf("decode calls: %d on the dropping engine, %d on the healthy one", b, g)
	// Every request decoded on the dropping engine moved once, to the
	// healthy one, which so saw all of them.
	if g != n || b == 0 || b > n {
		t.Errorf("decode calls: %d on the dropping engine, %d on the healthy one; want 1 to %d, and %d", b, g, n, n)
	}
}

// TestReplayOfAContinuation: a stream moves once, its continuation breaks
// past the limit, and the request is dead-lettered as that continuation.
// Its replay must run the original request, not the continuation: the
// record's answer is the whole answer, all its tokens counted against the
// client's own prompt.
func TestReplayOfAContinuation(t *testing.T) {
	c := droppingCluster(t)
	const tokens = 16
	s := postStream(t, c.url+"/v1/completions", "mig-replay", completionBody(model, longPrompt,
		body{"max_tokens": tokens, "ignore_eos": true, "stream": true, "stream_options": body{"include_usage": true}}))
	if s.status != 200 || lcInStreamError(s) == nil {
		t.Fatalf("status %d, events %q: want an in-stream error past the migration limit", s.status, s.events)
	}
	setFault(t, c.decode, `{"rate":0}`)
	replay := c.replay("--id", "mig-replay")
	rec := c.record("mig-replay")
	res, _, err := checkResponse(response{status: 200, body: rec.Result})
	if rec.State != dispatcher.StateDone || err != nil {
		t.Fatalf("replayed record %+v (%v)\n%s", rec, err, replay.stdout.String())
	}
	prompt := int(tokenizer.CountTokens(longPrompt))
	if res.usage.CompletionTokens != tokens || res.usage.PromptTokens != prompt || tokenizer.CountTokens(res.text) != tokens {
		t.Errorf("the replay answered %+v, %q: want the original request's %d tokens to a prompt of %d", res.usage, res.text, tokens, prompt)
	}
}

// TestBrokenStreamWithoutMigration: with migration off, a stream its
// decode engine breaks after output ends with the in-stream 502 that
// says so (found by review: a nil transcript made it a panic, and so a
// 500).
func TestBrokenStreamWithoutMigration(t *testing.T) {
	p := startPipeline(t, pipelineOptions{}) // the workers' PDQ_MIGRATION_LIMIT is 0
	setFault(t, p.decode[0], `{"rate":1,"kind":"drop"}`)
	s := postStream(t, p.completions(), "", completionBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true}))
	e := lcInStreamError(s)
	if s.status != 200 || !s.done || e == nil || e.Code != 502 || !strings.Contains(e.Message, "broke off") {
		t.Fatalf("status %d, done %v, error %+v: want an in-stream 502 saying the stream broke off", s.status, s.done, e)
	}
}
