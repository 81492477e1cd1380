package tests

import (
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestMigrationBounds drops every decode stream halfway: a request that
// cannot be continued from its text (echo) ends with an in-stream error at
// once, and one that can moves once (PDQ_MIGRATION_LIMIT=1), to the same
// dropping engine here, and then ends with an in-stream error, its text
// grown by what the continuation said first.
func TestMigrationBounds(t *testing.T) {
	// The breaker would open on these failures and probe the engine with
	// requests of its own, which this test counts: it is not the subject.
	c := startCluster(t, clusterOptions{env: []string{"PDQ_MIGRATION_LIMIT=1", "PDQ_BREAKER_FAILURES=100"}})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	setFault(t, c.decode, `{"rate":1,"kind":"drop"}`)
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
			if n := sim.CountTokens(sum.text); n != tc.words {
				t.Errorf("the client got %d words (%q), want %d", n, sum.text, tc.words)
			}
			after := c.decode.WaitStats(t, 10*time.Second, "the decode engine idle", func(s sim.Stats) bool { return s.Running == 0 })
			if n := after.Requests - before.Requests; n != int64(tc.calls) {
				t.Errorf("%d decode calls, want %d", n, tc.calls)
			}
		})
	}
}
