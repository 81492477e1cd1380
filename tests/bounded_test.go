package tests

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestReplayDeadline replays a dead letter onto a decode engine that hangs:
// the replay has no client to give up on it, and a non-streamed decode
// without max_tokens has no other bound, so only the request's fresh
// deadline can stop the engine's work and end the record.
func TestReplayDeadline(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	decode := p.decode[0]
	setFault(t, decode, `{"rate":1,"kind":"500"}`)
	r := post(t, p.completions(), "replay-deadline", completionBody(model, longPrompt, body{}))
	r.wantStatus(t, http.StatusBadGateway)

	setFault(t, decode, `{"rate":1,"kind":"hang"}`)
	ctx := context.Background()
	rp, err := dispatcher.NewReplayer(ctx, p.js, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	dl, err := rp.Find(ctx, "replay-deadline")
	if err != nil {
		t.Fatal(err)
	}
	before := decode.Stats(t)
	if _, err := rp.Replay(ctx, dl); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rec, err := rp.Wait(wctx, "replay-deadline")
	if err != nil || rec.State != dispatcher.StateExpired {
		t.Fatalf("replayed record %+v (%v), want expired at its 1 s deadline", rec, err)
	}
	// The hung decode call was aborted, not left running for nobody.
	decode.WaitStats(t, 5*time.Second, "the hung decode aborted", func(s sim.Stats) bool { return s.Aborts > before.Aborts })
}
