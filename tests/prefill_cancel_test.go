package tests

import (
	"context"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestCancelAsPrefillAnswers leaves a request at the moment its prefill
// engine has done the work and its answer is on the way (the sim's "late"
// fault). The engine holds the prompt's KV for that answer's params; a
// worker that drops the answer leaves the KV held for its lease, 30 s
// here and 480 s in vLLM. The worker must take the answer in, so that the
// KV is released (a one-token read), and no decode must run for the
// client.
func TestCancelAsPrefillAnswers(t *testing.T) {
	c := startCluster(t, clusterOptions{prefillSim: []string{"--fault-kind", "late", "--fault-delay", "60ms", "--fault-rate", "1"}})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	handoffs := c.tap(dispatcher.JobSubject(dispatcher.StageDecode, "*", "late-answer"))
	before, decodeBefore := c.prefill.Stats(t), c.decode.Stats(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		resp, err := send(ctx, c.url+"/v1/chat/completions", "late-answer", chatBody(model, longPrompt, body{"max_tokens": 50, "stream": true}))
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	// The prefill's work is done and its KV held; its answer comes 60 ms
	// later, within the worker's 100 ms wait. The client leaves now.
	c.prefill.WaitStats(t, 10*time.Second, "the prefill done", func(s sim.Stats) bool { return s.Prefills > before.Prefills })
	cancel()
	<-done
	after := c.prefill.WaitStats(t, 10*time.Second, "the prefill's KV released", func(s sim.Stats) bool { return s.BlocksHeld == 0 })
	// The release is a one-token decode that reads the KV; anything more
	// would be a decode for a client that has left.
	d := c.decode.WaitStats(t, 10*time.Second, "the decode engine idle", func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 })
	if d.Decodes-decodeBefore.Decodes > 1 || d.GenerationTokens-decodeBefore.GenerationTokens > 1 {
		t.Errorf("decode engine before %+v, after %+v: more than a one-token release for a client that had left", decodeBefore, d)
	}
	// The KV is released from the prefill side: no handoff is queued for a
	// client that has left.
	c.flush()
	if n, _, _ := handoffs.Pending(); n != 0 {
		t.Errorf("%d handoffs queued for a client that had left", n)
	}
	t.Logf("prefill engine after: %+v", after)
}
