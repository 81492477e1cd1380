package tests

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestShutdownGraceCutsGatewayStream is TestShutdownGraceCutsDecodeStream
// with SIGTERM sent to the gateway that holds the client (docs/deploy.md:
// the gateway's grace is PDQ_SHUTDOWN_GRACE too), and to pdq up, which
// runs the gateway and the workers in one process.
func TestShutdownGraceCutsGatewayStream(t *testing.T) {
	t.Run("gateway", func(t *testing.T) {
		c := graceCluster(t)
		before := c.decode.Stats(t)
		r := startCutStream(t, c.url, "grace-gateway")
		sigterm(t, c.gateway)
		s := readCut(r)
		s.check(t)
		if s.apiErr.Code != http.StatusServiceUnavailable {
			t.Errorf("in-stream error %+v, want the gateway's 503", s.apiErr)
		}
		engineStopped(t, c.decode, before)
	})
	t.Run("gateway, not streamed", func(t *testing.T) {
		c := graceCluster(t)
		before := c.decode.Stats(t)
		type answer struct {
			r   response
			err error
		}
		answered := make(chan answer, 1)
		go func() {
			r, err := tryPost(c.url+openai.Completions.Path(), "grace-whole",
				completionBody(model, longPrompt, body{"max_tokens": graceStreamTokens, "ignore_eos": true}))
			answered <- answer{r, err}
		}()
		c.decode.WaitStats(t, 15*time.Second, "the decode running", func(s sim.Stats) bool { return s.Running == 1 })
		sigterm(t, c.gateway)
		a := <-answered
		if a.err != nil {
			t.Fatalf("no answer after SIGTERM: %v; want a 503", a.err)
		}
		a.r.wantStatus(t, http.StatusServiceUnavailable)
		if e := a.r.apiError(t); e.Message == "" {
			t.Errorf("error %+v, want a message", e)
		}
		engineStopped(t, c.decode, before)
	})
	t.Run("gateway, a streamed batch", func(t *testing.T) {
		c := graceCluster(t)
		before := c.decode.Stats(t)
		const id = "grace-batch"
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		resp, err := send(ctx, c.url+openai.Completions.Path(), id, completionBody(model, "",
			body{"prompt": []string{longPrompt, longPrompt + " again"}, "max_tokens": graceStreamTokens, "ignore_eos": true, "stream": true}))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		r := openai.NewSSEReader(resp.Body)
		for i := range cutFirst {
			if _, err := r.Next(); err != nil {
				t.Fatalf("event %d: %v", i, err)
			}
		}
		c.decode.WaitStats(t, 15*time.Second, "both prompts decoding", func(s sim.Stats) bool { return s.Running == 2 })
		sigterm(t, c.gateway)
		cut := readCut(r)
		cut.check(t)
		if cut.apiErr.Code != http.StatusServiceUnavailable {
			t.Errorf("in-stream error %+v, want the gateway's 503", cut.apiErr)
		}
		// Both prompts' records end, with the gateway's 503 (read through
		// a new gateway): the one whose reply failed is failed, the other
		// cancelled, as docs/reliability.md says. And no engine works on
		// for either.
		c.startGateway()
		states := map[dispatcher.State]int{}
		for i := range 2 {
			pid := fmt.Sprintf("%s-%d", id, i)
			states[c.state(pid)]++
			if rec := c.record(pid); rec.Error == nil || rec.Error.Status != http.StatusServiceUnavailable {
				t.Errorf("record of prompt %d: %+v, want the gateway's 503", i, rec)
			}
		}
		if states[dispatcher.StateFailed] != 1 || states[dispatcher.StateCancelled] != 1 {
			t.Errorf("the prompts' records ended %v; want one failed and one cancelled", states)
		}
		after := c.decode.WaitStats(t, 15*time.Second, "the cut decodes stopped", func(s sim.Stats) bool { return s.Running == 0 })
		if d := lcDelta(after, before); d.Aborts != 2 || lcFinished(d) != 0 {
			t.Errorf("decode engine %+v: want both prompts aborted, none run to its end", d)
		}
	})
	t.Run("pdq up", func(t *testing.T) {
		_, pe := startSimProcess(t)
		_, de := startSimProcess(t, "--itl", "50ms")
		up, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+de.URL, "PDQ_SHUTDOWN_GRACE=1s")
		before := de.Stats(t)
		r := startCutStream(t, url, "grace-up")
		sigterm(t, up)
		s := readCut(r)
		s.check(t)
		engineStopped(t, de, before)
	})
}

// graceCluster is a gateway with a 1 s shutdown grace, and a prefill and
// a decode worker whose engine says a token every 50 ms: a long answer
// outlasts the grace.
func graceCluster(t *testing.T) *cluster {
	c := startCluster(t, clusterOptions{decodeSim: []string{"--itl", "50ms"}, env: []string{"PDQ_SHUTDOWN_GRACE=1s"}})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	return c
}
