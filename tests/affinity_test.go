package tests

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// TestAffinityThroughUp runs pdq up with two prefill engines (batched, of
// the seed profile) and sends each of ten documents three times with
// different questions: every request of a document must go to one prefill
// engine, the one whose prefix cache holds the document, and the
// documents must be spread over both engines.
func TestAffinityThroughUp(t *testing.T) {
	batched := []string{"--profile", "seed", "--time-scale", "0.02", "--enable-prompt-tokens-details"}
	_, p1 := startSimProcess(t, batched...)
	_, p2 := startSimProcess(t, batched...)
	_, d := startSimProcess(t, batched...)
	up, url := startUp(t, "PDQ_LOG_LEVEL=debug", "PDQ_PREFILL_ENGINES="+p1.URL+","+p2.URL, "PDQ_DECODE_ENGINES="+d.URL)
	defer func() {
		if t.Failed() {
			for _, l := range strings.Split(up.output(), "\n") {
				if strings.Contains(l, "aff-") && (strings.Contains(l, "queued") || strings.Contains(l, "pulled") || strings.Contains(l, "prefill")) {
					t.Log(l)
				}
			}
		}
	}()
	engines := map[string]*simtest.Engine{p1.URL: p1, p2.URL: p2}
	used := map[string]int{}
	for doc := range 10 {
		text := strings.Repeat(fmt.Sprintf("document %d says something of its own. ", doc), 60)
		where := ""
		for q := range 3 {
			id := fmt.Sprintf("aff-%d-%d", doc, q)
			post(t, url+"/v1/completions", id, completionBody(model, text+fmt.Sprintf(" Question %d?", q), body{"max_tokens": 4})).wantStatus(t, http.StatusOK)
			on := ""
			for u, e := range engines {
				if len(e.Requests(t, id)) > 0 {
					on = u
				}
			}
			switch {
			case on == "":
				t.Fatalf("%s reached no prefill engine", id)
			case where == "":
				where = on
				used[on]++
			case on != where:
				t.Errorf("%s went to %s, the document's earlier requests to %s", id, on, where)
			}
		}
	}
	if len(used) != 2 {
		t.Errorf("documents per prefill engine %v, want both engines used", used)
	}
	hits := p1.Stats(t).PrefixHitTokens + p2.Stats(t).PrefixHitTokens
	t.Logf("documents per engine %v; prefix-cache hits on the prefill engines: %d tokens", used, hits)
}
