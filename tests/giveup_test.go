package tests

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// TestGatewayGivesUpAndCancels breaks a reply stream the ways the gateway
// cannot recover from, an end that disowns chunks already relayed and a
// decode that starts over after output, by injecting the message into the
// real reply subject. (A lost chunk is sent again: see dispatcher's
// TestReplies.) The client
// gets an in-stream error, and the decode engine must stop at once instead
// of generating up to max_tokens for nobody.
func TestGatewayGivesUpAndCancels(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.ITL = 20 * time.Millisecond
	p := startPipeline(t, pipelineOptions{sim: cfg})
	for _, tc := range []struct {
		name    string
		kind    string
		attempt func(seen int) int
		seq     func(sent int) int
		want    string
	}{
		{"an end short of the chunks relayed", dispatcher.KindDone, func(seen int) int { return seen }, func(sent int) int { return max(sent-1, 0) }, "lost in transit"},
		{"a decode restarted after output", dispatcher.KindChunk, func(seen int) int { return seen + 1 }, func(int) int { return 0 }, "restarted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "giveup-" + strings.ReplaceAll(tc.name, " ", "-")
			sub, err := p.nc.SubscribeSync("pdq.reply.*." + id)
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			before := p.decode[0].Stats(t)
			res := make(chan stream, 1)
			go func() {
				res <- postStream(t, p.completions(), id, completionBody(model, longPrompt, body{"max_tokens": 300, "ignore_eos": true, "stream": true}))
			}()
			var first *nats.Msg
			for range 3 { // let a few chunks through first
				if first, err = sub.NextMsg(10 * time.Second); err != nil {
					t.Fatal(err)
				}
			}
			seen, seq := chunkNumbers(t, first)
			bad := nats.NewMsg(first.Subject)
			bad.Header.Set(dispatcher.HeaderKind, tc.kind)
			bad.Header.Set(dispatcher.HeaderSeq, itoa(tc.seq(seq)))
			bad.Header.Set(dispatcher.HeaderAttempt, itoa(tc.attempt(seen)))
			bad.Data = []byte(`{"choices":[]}`)
			if err := p.nc.PublishMsg(bad); err != nil {
				t.Fatal(err)
			}
			s := <-res
			if s.status != 200 || len(s.events) == 0 || !strings.Contains(string(s.events[len(s.events)-1]), tc.want) {
				t.Fatalf("stream status %d, last event %q; want an in-stream error about %q", s.status, s.events[len(s.events)-1:], tc.want)
			}
			after := p.decode[0].WaitStats(t, 10*time.Second, "the decode stopped", func(s sim.Stats) bool { return s.Running == 0 })
			if after.Decodes != before.Decodes || after.Aborts <= before.Aborts {
				t.Errorf("decode engine finished %d and aborted %d requests after the gateway gave up; want 0 finished, 1 aborted",
					after.Decodes-before.Decodes, after.Aborts-before.Aborts)
			}
			r := get(t, p.url+"/v1/requests/"+id)
			var rec dispatcher.Record
			r.decode(t, &rec)
			if rec.State != dispatcher.StateFailed || rec.Error == nil || rec.Error.Status != 502 {
				t.Errorf("record %+v, want failed with 502", rec)
			}
		})
	}
}

// chunkNumbers reads a chunk message's attempt and first sequence number,
// from its frame ("<attempt> <seq> <count>\n", which this build's workers
// send) or its headers.
func chunkNumbers(t *testing.T, m *nats.Msg) (attempt, seq int) {
	t.Helper()
	if len(m.Header) > 0 {
		return atoi(m.Header.Get(dispatcher.HeaderAttempt)), atoi(m.Header.Get(dispatcher.HeaderSeq))
	}
	line, _, _ := strings.Cut(string(m.Data), "\n")
	f := strings.Fields(line)
	if len(f) != 3 {
		t.Fatalf("a chunk with neither headers nor a frame: %q", m.Data)
	}
	return atoi(f[0]), atoi(f[1])
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

func itoa(n int) string { return strconv.Itoa(n) }
