package tests

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// TestAffinityThroughUp runs pdq up with two prefill and two decode
// engines (batched, of the seed profile) and sends each of ten documents
// three times with different questions: every request of a document must
// go to one prefill engine, the one whose prefix cache holds the
// document, and to one decode engine, which caches it too; and the
// documents must be spread over both engines of each stage.
//
// With PDQ_FAIR_LIMIT=engines a document's first prefill prefers no
// engine (its prompt is new to all: the first free worker takes it), and
// the gateway learns its engine from the prefill's end: the document's
// later requests go there all the same. Which engine runs a first prefill
// is the workers' pulls' choice there, so the spread is not asked of it.
func TestAffinityThroughUp(t *testing.T) {
	for _, limit := range []string{"slots", "engines"} {
		t.Run(limit, func(t *testing.T) { affinityThroughUp(t, limit) })
	}
}

func affinityThroughUp(t *testing.T, limit string) {
	batched := []string{"--profile", "seed", "--time-scale", "0.02", "--enable-prompt-tokens-details"}
	_, p1 := startSimProcess(t, batched...)
	_, p2 := startSimProcess(t, batched...)
	_, d1 := startSimProcess(t, batched...)
	_, d2 := startSimProcess(t, batched...)
	up, url := startUp(t, "PDQ_LOG_LEVEL=debug", "PDQ_PREFILL_ENGINES="+p1.URL+","+p2.URL, "PDQ_DECODE_ENGINES="+d1.URL+","+d2.URL,
		"PDQ_FAIR_LIMIT="+limit)
	defer func() {
		if t.Failed() {
			for _, l := range strings.Split(up.output(), "\n") {
				if strings.Contains(l, "aff-") && (strings.Contains(l, "queued") || strings.Contains(l, "pulled") || strings.Contains(l, "prefill")) {
					t.Log(l)
				}
			}
		}
	}()
	stages := []struct {
		name    string
		engines map[string]*simtest.Engine
		used    map[string]int // documents an engine
		where   map[int]string // document → engine
	}{
		{name: "prefill", engines: map[string]*simtest.Engine{p1.URL: p1, p2.URL: p2}},
		{name: "decode", engines: map[string]*simtest.Engine{d1.URL: d1, d2.URL: d2}},
	}
	for i := range stages {
		stages[i].used, stages[i].where = map[string]int{}, map[int]string{}
	}
	for doc := range 10 {
		text := strings.Repeat(fmt.Sprintf("document %d says something of its own. ", doc), 60)
		for q := range 3 {
			id := fmt.Sprintf("aff-%d-%d", doc, q)
			post(t, url+"/v1/completions", id, completionBody(model, text+fmt.Sprintf(" Question %d?", q), body{"max_tokens": 4})).wantStatus(t, http.StatusOK)
			for _, st := range stages {
				on := ""
				for u, e := range st.engines {
					if len(e.Requests(t, id)) > 0 {
						on = u
					}
				}
				switch where := st.where[doc]; {
				case on == "":
					t.Fatalf("%s reached no %s engine", id, st.name)
				case where == "":
					st.where[doc] = on
					st.used[on]++
				case on != where:
					t.Errorf("%s went to %s engine %s, the document's earlier requests to %s", id, st.name, on, where)
				}
			}
		}
	}
	// The gateway, not the order of the workers' pulls, sent a document's
	// later requests to its engine: they were queued preferring it.
	up.mu.Lock()
	recs := slices.Clone(up.recs)
	up.mu.Unlock()
	for doc, engine := range stages[0].where {
		for q := 1; q < 3; q++ {
			id := fmt.Sprintf("aff-%d-%d", doc, q)
			i := slices.IndexFunc(recs, func(r map[string]any) bool { return r["msg"] == "request queued" && r["request_id"] == id })
			if i < 0 {
				t.Errorf("%s: no \"request queued\" in pdq up's log", id)
			} else if got := recs[i]["prefer"]; got != dispatcher.EngineKey(engine) {
				t.Errorf("%s was queued preferring %v, want the document's engine %s", id, got, dispatcher.EngineKey(engine))
			}
		}
	}
	for _, st := range stages {
		if limit == "engines" && st.name == "prefill" {
			continue
		}
		if len(st.used) != 2 {
			t.Errorf("documents per %s engine %v, want both engines used", st.name, st.used)
		}
	}
	hits := p1.Stats(t).PrefixHitTokens + p2.Stats(t).PrefixHitTokens
	decodeHits := d1.Stats(t).PrefixHitTokens + d2.Stats(t).PrefixHitTokens
	t.Logf("documents per engine %v, %v; prefix-cache hits on the prefill engines: %d tokens, on the decode engines: %d",
		stages[0].used, stages[1].used, hits, decodeHits)
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
