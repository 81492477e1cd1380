package tests

import (
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
		c := startCluster(t, clusterOptions{decodeSim: []string{"--itl", "50ms"}, env: []string{"PDQ_SHUTDOWN_GRACE=1s"}})
		c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 4)
		c.ready()
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
		c := startCluster(t, clusterOptions{decodeSim: []string{"--itl", "50ms"}, env: []string{"PDQ_SHUTDOWN_GRACE=1s"}})
		c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 4)
		c.ready()
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
