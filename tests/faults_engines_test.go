package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// faultTimeouts are the stage deadlines of the engine-fault runs: short, so
// that a hung engine costs the run seconds, not minutes.
var faultTimeouts = []string{"PDQ_STALL_TIMEOUT=2s", "PDQ_PREFILL_TIMEOUT=2s"}

// durations are how long each client of ts waited.
func durations(ts []timed) []time.Duration {
	out := make([]time.Duration, len(ts))
	for i, t := range ts {
		out[i] = t.took
	}
	return out
}

// latency sums up a run's latencies: mean and max.
type latency struct{ mean, max time.Duration }

func measure(took []time.Duration) latency {
	var l latency
	for _, d := range took {
		l.mean += d
	}
	l.mean /= time.Duration(max(len(took), 1))
	l.max = slices.Max(took)
	return l
}

// cost is what a run cost its clients next to a baseline.
func (l latency) cost(base latency) string {
	return fmt.Sprintf("%+d ms mean, %+d ms max", (l.mean - base.mean).Milliseconds(), (l.max - base.max).Milliseconds())
}

// idleAndHeld waits until every engine is idle and the releases under way
// are done, and returns the blocks the prefill engines hold then.
func idleAndHeld(t *testing.T, within time.Duration, prefill []*simtest.Engine, decode []*simtest.Engine) int64 {
	t.Helper()
	idle := func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 }
	for _, e := range append(slices.Clone(decode), prefill...) {
		e.WaitStats(t, within, "the engine idle", idle)
	}
	time.Sleep(2 * time.Second) // a release tried again waits a second
	var held int64
	for _, e := range prefill {
		held += e.Stats(t).BlocksHeld
	}
	return held
}

// idleAndFreed waits until every engine is idle and no prefill engine holds
// blocks, and returns the blocks still held then.
func idleAndFreed(t *testing.T, within time.Duration, prefill []*simtest.Engine, decode []*simtest.Engine) int64 {
	t.Helper()
	idle := func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 }
	for _, e := range decode {
		e.WaitStats(t, within, "the decode engine idle", idle)
	}
	var held int64
	for _, e := range prefill {
		s, err := e.Poll(within, func(s sim.Stats) bool { return idle(s) && s.BlocksHeld == 0 })
		if err != nil {
			t.Errorf("prefill engine: %v", err)
		}
		held += s.BlocksHeld
	}
	return held
}

// engineFaultRows runs each fault kind of `pdq sim` at rate 0.3 on one of
// two engines of a stage, the other healthy, and returns a row per kind.
// Every accepted request must end in one answer; the faulty engine's
// share is retried, on another engine when one is free.
func engineFaultRows(t *testing.T, stage dispatcher.Stage) []row {
	// Leases of 60 s: the blocks held right after a row are those no
	// release freed, not ones a lease let go.
	lease := []string{"--kv-lease", "60s"}
	c := startCluster(t, clusterOptions{prefillSim: lease, env: faultTimeouts})
	_, second := startSimProcess(t, lease...)
	prefills, decodes := []*simtest.Engine{c.prefill}, []*simtest.Engine{c.decode}
	faulty := c.prefill
	if stage == dispatcher.StageDecode {
		faulty = c.decode
		decodes = append(decodes, second)
	} else {
		prefills = append(prefills, second)
	}
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 8)
	c.ready()
	c.worker(stage, 8, "PDQ_ENGINE_URL="+second.URL)

	const n = 20
	load := func(prefix string) ([]outcome, latency) {
		ts := c.timedLoad(n, prefix, func(int) body {
			return completionBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true})
		})
		return outcomes(ts), measure(durations(ts))
	}
	b0 := faulty.Stats(t)
	base, baseLat := load(string(stage) + "-base")
	b1 := faulty.Stats(t)
	// The blocks of one prompt, from the healthy load (one prompt for all).
	blockSize := int64(simconfig.DefaultConfig().BlockSize)
	promptBlocks := ((b1.PromptTokens-b0.PromptTokens)/max(b1.Prefills-b0.Prefills, 1) + blockSize - 1) / blockSize
	for _, o := range base {
		if !o.ok {
			t.Fatalf("the healthy baseline failed: %+v", base)
		}
	}
	var rows []row
	// A prefill engine that drops the connection after its prefill holds
	// the KV of params pdq never got: its blocks are the lease's, and the
	// row comes last, so that they count in no other.
	kinds := []simconfig.FaultKind{simconfig.Fault503, simconfig.Fault500, simconfig.Fault429, simconfig.FaultHang, simconfig.FaultNoKV, simconfig.FaultSlow, simconfig.FaultDrop}
	if stage == dispatcher.StageDecode {
		kinds = slices.DeleteFunc(kinds, func(k simconfig.FaultKind) bool { return k == simconfig.FaultNoKV }) // a prefill's fault
	}
	for _, kind := range kinds {
		// Each kind meets a pool whose faulty engine takes jobs again: a
		// breaker the last run opened has probed its way back, and its
		// trial (a request sent for it) has closed it.
		for i := 0; !c.breakerIs(faulty.URL, dispatcher.BreakerClosed); i++ {
			if i == 100 {
				t.Fatalf("the breaker on %s did not close", faulty.URL)
			}
			c.timedLoad(2, fmt.Sprintf("%s-%s-warm-%d", stage, kind, i), func(int) body {
				return completionBody(model, longPrompt, body{"max_tokens": 1})
			})
			time.Sleep(100 * time.Millisecond)
		}
		s0 := faulty.Stats(t)
		setFault(t, faulty, fmt.Sprintf(`{"rate":0.3,"kind":%q,"delay":"1s"}`, kind))
		outs, lat := load(fmt.Sprintf("%s-%s", stage, kind))
		setFault(t, faulty, `{"rate":0}`)
		s1 := faulty.Stats(t)
		injected := s1.Faults - s0.Faults
		r := row{scenario: fmt.Sprintf("%s engine: %s at rate 0.3, 2nd engine healthy", stage, kind),
			cost: fmt.Sprintf("%d faults: %s", injected, lat.cost(baseLat))}
		tally(&r, outs)
		for _, o := range outs {
			if !o.ok { // allowed (every attempt may meet the fault), but said
				t.Logf("%s: status %d, err %q, tail %q", r.scenario, o.status, o.err, o.tail)
			}
		}
		if stage == dispatcher.StagePrefill && kind == simconfig.FaultDrop {
			r.blocksHeld = idleAndHeld(t, 20*time.Second, prefills, decodes)
			r.byLimit = true
			// Exactly the blocks of the prefills whose answer was dropped
			// (a breaker's dropped probe holds none), and no other: read
			// again for a while, as a release tried again may be late.
			var unread, want int64
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
				s := faulty.Stats(t)
				unread = (s.Prefills - s0.Prefills) - (s.KVServed - s0.KVServed)
				if want = unread * promptBlocks; r.blocksHeld == want || time.Now().After(deadline) {
					break
				}
				r.blocksHeld = 0
				for _, e := range prefills {
					r.blocksHeld += e.Stats(t).BlocksHeld
				}
			}
			if r.blocksHeld != want {
				t.Errorf("%d blocks held after %d prefills left unread (%d faults): want %d, %d per prompt", r.blocksHeld, unread, injected, want, promptBlocks)
			}
			r.cost += fmt.Sprintf("; %d blocks to the lease", r.blocksHeld)
		} else {
			r.blocksHeld = idleAndFreed(t, 20*time.Second, prefills, decodes)
		}
		rows = append(rows, r)
	}
	return rows
}

// deadPrefillRow kills the only prefill engine: long prompts must go
// decode-only (the fallback), costing about what a decode-only request
// costs, instead of retries and a 502.
func deadPrefillRow(t *testing.T) row {
	c := startCluster(t, clusterOptions{env: faultTimeouts})
	pw := c.worker(dispatcher.StagePrefill, 4, "PDQ_METRICS_ADDR=127.0.0.1:0")
	prefillMetrics := "http://" + pw.waitLog(t, "serving metrics")["addr"].(string) + "/metrics"
	c.worker(dispatcher.StageDecode, 8)
	c.ready()
	short := func(int) body {
		return completionBody(model, "Hi", body{"max_tokens": 16, "ignore_eos": true, "stream": true})
	}
	long := func(int) body {
		return completionBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true})
	}
	sequential := func(prefix string, mk func(int) body) ([]outcome, []time.Duration) {
		var outs []outcome
		var took []time.Duration
		for i := range 4 {
			start := time.Now()
			outs = append(outs, c.one(fmt.Sprintf("%s-%d", prefix, i), 0, mk(i)))
			took = append(took, time.Since(start))
		}
		return outs, took
	}
	_, baseTook := sequential("dp-base", short)
	kill9(t, c.prefillP)
	outs, took := sequential("dp-seq", long)
	ts := c.timedLoad(8, "dp-burst", long)
	burst, burstTook := outcomes(ts), durations(ts)
	r := row{scenario: "dead prefill engine: decode-only fallback"}
	tally(&r, append(outs, burst...))
	r.cost = measure(append(took, burstTook...)).cost(measure(baseTook)) + " vs decode-only"
	c.decode.WaitStats(t, 10*time.Second, "the decode engine idle", func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 })
	// Counted where they happened: at the gateway once it saw the breaker
	// open, before that by the prefill worker, which forwarded its jobs.
	if n := counter(t, c.url+"/metrics", "pdq_prefill_fallbacks_total") + counter(t, prefillMetrics, "pdq_prefill_fallbacks_total"); n != 12 {
		t.Errorf("pdq_prefill_fallbacks_total adds up to %v at the gateway and the prefill worker, want 12", n)
	}
	return r
}

// hungDecodeRow hangs every request on one of two decode engines, as in
// issue 7's report (4 of 8 requests got a 504 after 10 minutes): the
// stall time-out and the breaker must send them to the healthy engine.
func hungDecodeRow(t *testing.T) row {
	lease := []string{"--kv-lease", "5s"}
	c := startCluster(t, clusterOptions{prefillSim: lease, env: faultTimeouts})
	_, second := startSimProcess(t)
	c.worker(dispatcher.StagePrefill, 4)
	hung := c.worker(dispatcher.StageDecode, 4, "PDQ_LOG_LEVEL=debug")
	c.ready()
	healthy := c.worker(dispatcher.StageDecode, 4, "PDQ_ENGINE_URL="+second.URL, "PDQ_LOG_LEVEL=debug")
	// On failure, the workers' lines about the request and the breaker
	// say which engine each generation met.
	pdLoad := func(prefix string) ([]outcome, latency) {
		ts := c.timedLoad(8, prefix, func(int) body {
			return completionBody(model, longPrompt, body{"max_tokens": 16, "ignore_eos": true, "stream": true})
		})
		return outcomes(ts), measure(durations(ts))
	}
	_, base := pdLoad("hd-base")
	setFault(t, c.decode, `{"rate":1,"kind":"hang"}`)
	outs, lat := pdLoad("hd")
	setFault(t, c.decode, `{"rate":0}`)
	for i, o := range outs {
		if !o.ok {
			rec := c.record(fmt.Sprintf("hd-%d", i))
			t.Logf("not completed: %+v; record: generation %d, %+v", o, rec.Generation, rec.Error)
			for _, p := range []*process{hung, healthy} {
				for _, line := range strings.Split(p.output(), "\n") {
					if strings.Contains(line, fmt.Sprintf("hd-%d", i)) || strings.Contains(line, "breaker") || strings.Contains(line, "healthy") {
						t.Logf("%s: %s", p.name, line)
					}
				}
			}
		}
	}
	r := row{scenario: "hung decode engine (every request), 2nd healthy", cost: lat.cost(base)}
	tally(&r, outs)
	if r.completed != len(outs) {
		// A healthy engine stands by: a hung one must cost time, not answers.
		t.Errorf("%d of %d completed; want all, from the healthy engine", r.completed, len(outs))
	}
	r.blocksHeld = idleAndFreed(t, 20*time.Second, []*simtest.Engine{c.prefill}, []*simtest.Engine{c.decode, second})
	return r
}

// counter sums the values of a Prometheus counter's series at url.
func counter(t *testing.T, url, name string) float64 {
	t.Helper()
	var sum float64
	for _, line := range strings.Split(string(get(t, url).body), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
			sum += v
		}
	}
	return sum
}

// streamSummary is what a client of a streamed answer got: its text, the
// usage chunk, and whether it was whole.
type streamSummary struct {
	text              string
	chunks            int
	created           map[int64]bool
	ids               map[string]bool
	prompt, generated int
	whole             bool // ended in [DONE], no error event
}

func summarize(s stream) streamSummary {
	sum := streamSummary{created: map[int64]bool{}, ids: map[string]bool{}, whole: s.status == 200 && s.done && s.err == nil}
	for _, ev := range s.events {
		var c struct {
			ID      string `json:"id"`
			Created int64  `json:"created"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				Prompt     int `json:"prompt_tokens"`
				Completion int `json:"completion_tokens"`
			} `json:"usage"`
			Error any `json:"error"`
		}
		if json.Unmarshal(ev, &c) != nil || c.Error != nil {
			sum.whole = false
			continue
		}
		sum.ids[c.ID], sum.created[c.Created] = true, true
		for _, ch := range c.Choices {
			sum.text += ch.Text + ch.Delta.Content
			sum.chunks++
		}
		if c.Usage != nil {
			sum.prompt, sum.generated = c.Usage.Prompt, c.Usage.Completion
		}
	}
	return sum
}

// migrationRow kills a decode engine mid-stream: each of its streams must
// go on, on the other engine, as one uninterrupted stream to its client:
// the same length of text as an uninterrupted run, one id, one created
// time, usage that counts the original prompt and every token, [DONE].
func migrationRow(t *testing.T) row {
	itl := []string{"--itl", "10ms"}
	c := startCluster(t, clusterOptions{decodeSim: itl, env: faultTimeouts})
	_, second := startSimProcess(t, itl...)
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	c.worker(dispatcher.StageDecode, 4, "PDQ_ENGINE_URL="+second.URL)
	const tokens = 150
	bodies := []func() (string, body){
		func() (string, body) {
			return c.url + "/v1/completions", completionBody(model, longPrompt, body{"max_tokens": tokens, "ignore_eos": true,
				"stream": true, "stream_options": body{"include_usage": true}})
		},
		func() (string, body) {
			return c.url + "/v1/chat/completions", body{"model": model, "messages": []body{{"role": "user", "content": longPrompt}},
				"max_completion_tokens": tokens, "ignore_eos": true, "stream": true, "stream_options": body{"include_usage": true}}
		},
	}
	run := func(id string, i int) (streamSummary, time.Duration) {
		url, b := bodies[i%2]()
		start := time.Now()
		s := postStream(t, url, id, b)
		return summarize(s), time.Since(start)
	}
	var base [2]streamSummary
	var baseTook []time.Duration
	for i := range 2 {
		var d time.Duration
		base[i], d = run(fmt.Sprintf("mig-base-%d", i), i)
		baseTook = append(baseTook, d)
		if !base[i].whole || base[i].generated != tokens {
			t.Fatalf("baseline %d: %+v", i, base[i])
		}
	}
	const n = 6
	sums := make([]streamSummary, n)
	took := make([]time.Duration, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { sums[i], took[i] = run(fmt.Sprintf("mig-%d", i), i) })
	}
	c.decode.WaitStats(t, 10*time.Second, "streams under way on the first decode engine",
		func(s sim.Stats) bool { return s.Running >= 2 && s.GenerationTokens >= 100 })
	kill9(t, c.decodeP)
	wg.Wait()
	r := row{scenario: "decode engine killed mid-stream: migration", cost: measure(took).cost(measure(baseTook))}
	for i, s := range sums {
		b := base[i%2]
		switch {
		case !s.whole:
			r.accepted++
			r.errors++
			t.Errorf("stream %d broke: %+v", i, s)
		case tokenizer.CountTokens(s.text) != tokenizer.CountTokens(b.text) || s.generated != b.generated || s.prompt != b.prompt ||
			len(s.ids) != 1 || len(s.created) != 1:
			r.accepted++
			r.errors++
			t.Errorf("stream %d: %d tokens of text, usage %d+%d, %d ids, %d created times; want %d tokens, usage %d+%d, 1, 1",
				i, tokenizer.CountTokens(s.text), s.prompt, s.generated, len(s.ids), len(s.created),
				tokenizer.CountTokens(b.text), b.prompt, b.generated)
		default:
			r.accepted++
			r.completed++
		}
	}
	second.WaitStats(t, 10*time.Second, "the second decode engine idle", func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 })
	return r
}

// breakerIs reports whether the breaker of the worker on engine is in
// state, as its registry entry says.
func (c *cluster) breakerIs(engine string, state dispatcher.BreakerState) bool {
	c.t.Helper()
	kv, err := c.js.KeyValue(context.Background(), dispatcher.BucketWorkers)
	if err != nil {
		c.t.Fatal(err)
	}
	keys, _ := kv.Keys(context.Background())
	for _, k := range keys {
		e, err := kv.Get(context.Background(), k)
		if err != nil {
			continue
		}
		var w dispatcher.WorkerInfo
		if json.Unmarshal(e.Value(), &w) == nil && w.Engine == engine {
			return w.Breaker == state
		}
	}
	return false
}
