package tests

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
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

// TestAffinityKilledWorker: kill -9 of a prefill worker while jobs that
// prefer its engine run there, or wait in its engine's consumer: the
// other engine's worker takes them over once their ack wait has run out
// (1 s here), and every request is answered.
func TestAffinityKilledWorker(t *testing.T) {
	slow := []string{"--prefill-overhead", "1500ms"}
	c := startCluster(t, clusterOptions{prefillSim: slow})
	_, second := startSimProcess(t, slow...)
	doomed := c.worker(dispatcher.StagePrefill, 2)
	c.workerFor(second, dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 8)
	c.ready()
	// Four documents: the gateway spreads them over both engines, two
	// each, so the doomed worker's run (delivered, not acked), with none
	// left undelivered in its consumer.
	outs := make(chan []outcome, 1)
	go func() {
		outs <- c.load(4, "killed", 0, func(i int) body {
			doc := strings.Repeat(fmt.Sprintf("document %d, which its engine keeps. ", i), 20)
			return completionBody(model, doc, body{"max_tokens": 4})
		})
	}()
	c.prefill.WaitStats(t, 10*time.Second, "prefills running on the doomed worker's engine", func(s sim.Stats) bool { return s.Running >= 2 })
	kill9(t, doomed)
	var served int
	for _, o := range <-outs {
		if o.ok {
			served++
		} else {
			t.Errorf("a request after the kill: %+v", o)
		}
	}
	if served != 4 {
		t.Errorf("%d of 4 served", served)
	}
	if s := second.Stats(t); s.Prefills < 4 {
		t.Errorf("the surviving engine ran %d prefills; want its own and the killed worker's", s.Prefills)
	}
}
