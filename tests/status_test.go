package tests

import (
	"encoding/json"
	"os/exec"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
)

// pdqStatus runs `pdq status --json` against the cluster's NATS.
func (c *cluster) pdqStatus() (workers map[dispatcher.Stage]dispatcher.WorkerInfo, queues []dispatcher.QueueStatus) {
	c.t.Helper()
	out, err := exec.Command(pdqBinary, "status", "--json", "--nats", c.natsURL).Output()
	if err != nil {
		c.t.Fatalf("pdq status: %v", err)
	}
	var s struct {
		Workers []dispatcher.WorkerInfo  `json:"workers"`
		Queues  []dispatcher.QueueStatus `json:"queues"`
	}
	if err := json.Unmarshal(out, &s); err != nil {
		c.t.Fatalf("pdq status --json: %v\n%s", err, out)
	}
	workers = map[dispatcher.Stage]dispatcher.WorkerInfo{}
	for _, w := range s.Workers {
		workers[w.Role] = w
	}
	return workers, s.Queues
}

// TestStatusShowsEngineHealth: pdq status lists the workers with their
// engines' breakers and the pools' queues; a prefill engine that dies shows
// as an open breaker once a request has met it.
func TestStatusShowsEngineHealth(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	workers, queues := c.pdqStatus()
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		if w, ok := workers[stage]; !ok || w.Breaker != dispatcher.BreakerClosed || w.Pool != dispatcher.PoolName(model) || w.Slots != 2 {
			t.Errorf("%s worker %+v, want one of pool %s with 2 slots and a closed breaker", stage, w, dispatcher.PoolName(model))
		}
	}
	if len(queues) != 2 {
		t.Errorf("queues %+v, want the pool's prefill and decode queues", queues)
	}

	kill9(t, c.prefillP)
	if o := c.one("after-the-prefill-engine-died", 0, completionBody(model, longPrompt, body{"max_tokens": 4})); !o.ok {
		t.Fatalf("outcome %+v, want an answer, decode-only", o)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		workers, _ = c.pdqStatus()
		if workers[dispatcher.StagePrefill].Breaker == dispatcher.BreakerOpen {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("prefill worker %+v, want an open breaker", workers[dispatcher.StagePrefill])
		}
		time.Sleep(200 * time.Millisecond)
	}
}
