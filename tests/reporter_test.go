package tests

import (
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/queues"
)

// TestReporterKilled: the worker that lists a pool's queues for the others
// (dispatcher/queues) is killed with -9; another worker of the pool takes
// its place, and the pool's requests are served. Without it, the pool's
// take-over and decode gates would read no report but their own listings
// (each worker listing every consumer, the cost the reporter removed).
func TestReporterKilled(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	_, prefill2 := startSimProcess(t)
	procs := map[string]*process{ // engine → its prefill worker
		c.prefill.URL: c.worker(dispatcher.StagePrefill, 4),
		prefill2.URL:  c.workerFor(prefill2, dispatcher.StagePrefill, 4),
	}
	c.worker(dispatcher.StageDecode, 4)
	c.ready()

	// Who reports, and which engine each worker entry serves.
	var mu sync.Mutex
	var by string
	heard := map[string]bool{}     // the reporters heard since it was last emptied
	engines := map[string]string{} // worker entry id → engine URL
	pool := dispatcher.PoolName(model)
	reports, err := c.nc.Subscribe(dispatcher.QueuesSubject(dispatcher.StagePrefill, pool), func(m *nats.Msg) {
		var r queues.Report
		if json.Unmarshal(m.Data, &r) == nil {
			mu.Lock()
			by, heard[r.By] = r.By, true
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer reports.Unsubscribe()
	beats, err := c.nc.Subscribe(dispatcher.WorkerSubject("*"), func(m *nats.Msg) {
		var w dispatcher.WorkerInfo
		if json.Unmarshal(m.Data, &w) == nil && w.Role == dispatcher.StagePrefill {
			mu.Lock()
			engines[w.ID] = w.Engine
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer beats.Unsubscribe()
	reporter := func() string { // the reporting worker's engine, once known
		mu.Lock()
		defer mu.Unlock()
		return engines[by]
	}
	waitUntil(t, "a prefill worker reports the pool's queues", func() bool { return reporter() != "" })
	// Both report until they hear each other: the one left reporting over
	// two idle paces is the reporter.
	mu.Lock()
	clear(heard)
	mu.Unlock()
	time.Sleep(2 * queues.IdleEvery)
	mu.Lock()
	n := len(heard)
	mu.Unlock()
	if n != 1 {
		t.Fatalf("%d prefill workers reported over %v, want 1", n, 2*queues.IdleEvery)
	}
	first := reporter()
	kill9(t, procs[first])
	waitUntil(t, "the other prefill worker reports instead", func() bool { return reporter() != "" && reporter() != first })

	outs := c.load(4, "after-reporter", 0, pd(8, true))
	for _, o := range outs {
		if !o.ok {
			t.Errorf("a request after the reporter's death: %+v", o)
		}
	}
}
