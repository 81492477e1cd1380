package tests

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/admin"
)

// pdqStatus runs `pdq status --json` against the cluster's NATS.
func (c *cluster) pdqStatus() (workers map[dispatcher.Stage]dispatcher.WorkerInfo, queues []admin.QueueStatus) {
	c.t.Helper()
	out, err := exec.Command(pdqBinary, "status", "--json", "--nats", c.natsURL).Output()
	if err != nil {
		c.t.Fatalf("pdq status: %v", err)
	}
	var s struct {
		Workers []dispatcher.WorkerInfo `json:"workers"`
		Queues  []admin.QueueStatus     `json:"queues"`
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
		if w, ok := workers[stage]; !ok || w.Breaker != dispatcher.BreakerClosed || w.Pool != dispatcher.PoolName(model) || w.Slots != 2 || w.Seats < 1 || w.Seats > 2 {
			t.Errorf("%s worker %+v, want one of pool %s with 2 slots, 1 or 2 seats, and a closed breaker", stage, w, dispatcher.PoolName(model))
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

// TestStatusOnUp: pdq status against a live `pdq up` lists its prefill and
// decode workers and both of the pool's queues.
func TestStatusOnUp(t *testing.T) {
	up, _ := startUp(t, "PDQ_NATS_LISTEN=127.0.0.1:0")
	natsURL, _ := up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
	c := &cluster{t: t, natsURL: natsURL}
	workers, queues := c.pdqStatus()
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		if w, ok := workers[stage]; !ok || w.Breaker != dispatcher.BreakerClosed || w.Engine == "" {
			t.Errorf("%s worker %+v, want one with its engine and a closed breaker", stage, w)
		}
	}
	stages := map[dispatcher.Stage]bool{}
	for _, q := range queues {
		stages[q.Stage] = true
	}
	if !stages[dispatcher.StagePrefill] || !stages[dispatcher.StageDecode] {
		t.Errorf("queues %+v, want the prefill and the decode queue", queues)
	}
	out, err := exec.Command(pdqBinary, "status", "--nats", natsURL).Output()
	if err != nil || !strings.Contains(string(out), "WORKER") || !strings.Contains(string(out), "DEAD LETTERS") {
		t.Errorf("pdq status: %v\n%s", err, out)
	}
}
