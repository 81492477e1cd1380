package tests

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

// The fault suite's rows for the promises issue 23 found broken on the
// request's own path.

// lostCancelRow: clients leave mid-stream and their cancel broadcasts are
// lost. The gateway's NATS user may not publish on pdq.cancel.>, as if
// every broadcast went missing in a reconnect or a route flap; the
// gateway still records each request cancelled. The decodes must stop all
// the same, within a beat, instead of generating to their end for nobody.
func lostCancelRow(t *testing.T) row {
	c := lostCancelCluster(t, clusterOptions{
		env:        []string{"PDQ_STALL_TIMEOUT=2s"},
		prefillSim: []string{"--kv-lease", "60s"},
		decodeSim:  []string{"--itl", "50ms"},
	})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	d0 := c.decode.Stats(t)
	// 4 streams of 200 tokens, 10 s each; their clients leave after 1.5 s.
	outs := c.load(4, "lostcancel", 1500*time.Millisecond, func(int) body {
		return completionBody(model, longPrompt, body{"max_tokens": 200, "ignore_eos": true, "stream": true})
	})
	r := row{scenario: "lost cancels: clients leave mid-stream"}
	tally(&r, outs)
	// The decodes stop at their next beat (every 400 ms here) after their
	// client leaves; the row waits up to 5 s for them, and counts by the
	// engine's aborts that none went on to its end, for nobody.
	d1 := c.decode.WaitStats(t, 5*time.Second, "the decodes stopped", func(s sim.Stats) bool { return s.Running == 0 })
	r.cancelledCalls = d1.Decodes - d0.Decodes
	r.blocksHeld = c.settle(10 * time.Second)
	if r.left != 4 || d1.Aborts-d0.Aborts != 4 {
		t.Errorf("outcomes %+v, decode engine %+v after %+v: want 4 clients gone and 4 decodes aborted", outs, d1, d0)
	}
	for i := range 4 {
		if st := c.state("lostcancel-" + itoa(i)); st != dispatcher.StateCancelled {
			t.Errorf("lostcancel-%d: state %s, want cancelled", i, st)
		}
	}
	return r
}

// decodeBlipRows: the only decode engine is briefly unavailable, dead for
// 2 s (kill -9, then started again on its address) or answering 503 for
// 2 s, while P/D streams come in. A decode that never reached its engine
// has not read the KV: it must wait for the engine with its handoff, not
// prefill again or fail. Every stream completes, one prefill each.
func decodeBlipRows(t *testing.T) []row {
	var rows []row
	for _, blip := range []struct {
		name       string
		start, end func(c *cluster)
	}{
		{"decode engine down 2 s (kill -9, restart): P/D streams",
			func(c *cluster) { kill9(c.t, c.decodeP) },
			func(c *cluster) {
				c.decodeP, c.decode = startSimProcess(c.t, "--addr", strings.TrimPrefix(c.decode.URL, "http://"))
			}},
		{"decode engine answers 503 for 2 s: P/D streams",
			func(c *cluster) { setFault(c.t, c.decode, `{"rate":1,"kind":"503"}`) },
			func(c *cluster) { setFault(c.t, c.decode, `{"rate":0}`) }},
		// Two decode workers whose engines are both busy (a 429 opens no
		// breaker): a handoff must not bounce from one to the other until
		// its hand-backs run out, and then be prefilled again.
		{"both decode engines answer 429 for 2 s: P/D streams",
			func(c *cluster) {
				setFault(c.t, c.decode, `{"rate":1,"kind":"429"}`)
				setFault(c.t, c.decode2, `{"rate":1,"kind":"429"}`)
			},
			func(c *cluster) {
				setFault(c.t, c.decode, `{"rate":0}`)
				setFault(c.t, c.decode2, `{"rate":0}`)
			}},
	} {
		c := startCluster(t, clusterOptions{decodeAddr: freeAddr(t), prefillSim: []string{"--kv-lease", "60s"}})
		c.worker(dispatcher.StagePrefill, 4)
		c.worker(dispatcher.StageDecode, 8)
		if strings.HasPrefix(blip.name, "both") {
			_, c.decode2 = startSimProcess(t)
			c.workerFor(c.decode2, dispatcher.StageDecode, 8)
		}
		c.ready()
		p0 := c.prefill.Stats(t)
		blip.start(c)
		start := time.Now()
		var outs []timed
		done := make(chan struct{})
		go func() {
			outs = c.wave(6, 200*time.Millisecond, "blip", func(int) body {
				return completionBody(model, longPrompt, body{"max_tokens": 8, "ignore_eos": true, "stream": true})
			}, -1, nil)
			close(done)
		}()
		time.Sleep(2*time.Second - time.Since(start))
		blip.end(c)
		<-done
		r := row{scenario: blip.name}
		tally(&r, outcomes(outs))
		r.blocksHeld = c.settle(10 * time.Second)
		prefills := c.prefill.Stats(t).Prefills - p0.Prefills
		r.cost = fmt.Sprintf("%d prefills; longest %d ms", prefills, longest(outs).Milliseconds())
		if r.completed != 6 || prefills != 6 {
			t.Errorf("%s: %+v, %d prefills: want 6 completed, one prefill each", blip.name, outcomes(outs), prefills)
		}
		rows = append(rows, r)
	}
	return rows
}

// kvReleaseRows: failures after which pdq, not the engine's lease, frees a
// prefill's KV, counted right after each row with leases of 60 s, so that
// only a release can have freed the blocks.
//
// A streamed decode answered 500 before any output, its only engine
// failing every call: the engine never ran it (vLLM answers a stream's
// errors in the stream once it has begun), so each generation's KV is
// unread, and released as the request goes back to prefill. The same not
// streamed is the counter-case: such a 500 may come after the engine read
// the blocks, and a second read could be of blocks freed and reused, so
// the KV is left to the lease: exactly each generation's blocks stay
// held, and no second read of them is tried.
func kvReleaseRows(t *testing.T) []row {
	c := startCluster(t, clusterOptions{prefillSim: []string{"--kv-lease", "60s"}, env: []string{"PDQ_MAX_GENERATIONS=2"}})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	var rows []row
	for _, stream := range []bool{true, false} {
		name, id := "decode engine 500 before output: KV released", "kv500"
		if !stream {
			name, id = "the same, not streamed: KV left to the lease", "kv500whole"
		}
		p0, d0 := c.prefill.Stats(t), c.decode.Stats(t)
		setFault(t, c.decode, `{"rate":1,"kind":"500"}`)
		outs := c.load(4, id, 0, pd(8, stream))
		setFault(t, c.decode, `{"rate":0}`)
		r := row{scenario: name}
		tally(&r, outs)
		p1 := c.prefill.Stats(t)
		held := p1.BlocksHeld - p0.BlocksHeld // right after the answers, before any lease ends
		r.cost = fmt.Sprintf("%d prefills, %d blocks held at the answers", p1.Prefills-p0.Prefills, held)
		if r.errors != 4 || p1.HoldsExpired != p0.HoldsExpired {
			t.Errorf("%s: %+v, prefill engine %+v: want 4 errors and no hold expired", name, outs, p1)
		}
		if stream {
			r.blocksHeld = c.settle(5 * time.Second)
			rows = append(rows, r)
			continue
		}
		time.Sleep(2 * time.Second) // a release, were one made, would have run
		p2, d2 := c.prefill.Stats(t), c.decode.Stats(t)
		r.blocksHeld, r.byLimit = p2.BlocksHeld-p0.BlocksHeld, true
		perPrompt := (p1.PromptTokens - p0.PromptTokens) / max(p1.Prefills-p0.Prefills, 1)
		want := (p1.Prefills - p0.Prefills) * ((perPrompt + int64(simconfig.DefaultConfig().BlockSize) - 1) / int64(simconfig.DefaultConfig().BlockSize))
		if r.blocksHeld != want || p2.KVServed != p0.KVServed || d2.KVReads+d2.KVReadFailures != d0.KVReads+d0.KVReadFailures {
			t.Errorf("%s: %d blocks held, %d reads served; want %d held (each generation's), none read",
				name, r.blocksHeld, p2.KVServed-p0.KVServed, want)
		}
		rows = append(rows, r)
	}
	return rows
}

// killedDecodeWorkerRow: the only decode worker is killed (-9) while its
// streams run. Their stream cannot move (its transcript died with the
// worker), so each client gets an in-stream error once the handoff comes
// back as a new generation; those failures must be kept for replay, as a
// SIGTERM's are, and pdq replay --failed must answer them.
func killedDecodeWorkerRow(t *testing.T) row {
	c := startCluster(t, clusterOptions{decodeSim: []string{"--itl", "20ms"}})
	c.worker(dispatcher.StagePrefill, 2)
	a := c.worker(dispatcher.StageDecode, 4)
	c.ready()
	var outs []outcome
	done := make(chan struct{})
	go func() { outs = c.load(3, "killdec", 0, pd(100, true)); close(done) }()
	c.decode.WaitStats(t, 10*time.Second, "streams running", func(s sim.Stats) bool { return s.Running >= 3 })
	time.Sleep(200 * time.Millisecond) // output on its way to every client
	kill9(t, a)
	c.worker(dispatcher.StageDecode, 4)
	<-done
	r := row{scenario: "kill -9 of a decode worker mid-stream; replay"}
	tally(&r, outs)
	r.blocksHeld = c.settle(10 * time.Second)
	replay := c.replay("--failed")
	r.replayedN = r.errors
	for i := range 3 {
		if rec := c.record(fmt.Sprintf("killdec-%d", i)); rec.State == dispatcher.StateDone && len(rec.Result) > 0 {
			r.replayed++
		}
	}
	if r.errors != 3 || r.replayed != 3 {
		t.Errorf("outcomes %+v, %d replayed: want 3 in-stream errors, each replayed\n%s", outs, r.replayed, replay.stdout.String())
	}
	return r
}

// pd is a P/D completions request of tokens, streamed or not.
func pd(tokens int, stream bool) func(int) body {
	return func(int) body {
		return completionBody(model, longPrompt, body{"max_tokens": tokens, "ignore_eos": true, "stream": stream})
	}
}

// longPromptRow: a P/D request of the largest body the gateway takes
// (7 MiB, 1.2 million tokens to the engines), whose handoff carries some
// 80,000 block ids: answered through prefill, its KV read by the decode
// engine and so freed, not computed again.
func longPromptRow(t *testing.T) row {
	engine := []string{"--max-model-len", "4000000", "--prefill-per-token", "0", "--kv-transfer-per-block", "0", "--kv-lease", "60s"}
	c := startCluster(t, clusterOptions{prefillSim: engine, decodeSim: engine})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	b := sizedBody(config.MaxBodyBytes, 4)
	d0 := c.decode.Stats(t)
	start := time.Now()
	r := row{scenario: "P/D prompt of the largest body (7 MiB, 1.36M tokens)"}
	resp, err := tryDo(http.MethodPost, c.url+"/v1/completions", http.Header{"Content-Type": {"application/json"}}, b)
	o := outcome{status: resp.status, ok: err == nil && resp.status == http.StatusOK}
	if err != nil {
		o.err = "lost: " + err.Error()
	}
	tally(&r, []outcome{o})
	d1 := c.decode.Stats(t)
	r.blocksHeld = c.settle(10 * time.Second)
	r.cost = fmt.Sprintf("%d prompt tokens; %d ms", d1.PromptTokens-d0.PromptTokens, time.Since(start).Milliseconds())
	if !o.ok || d1.KVReads-d0.KVReads != 1 || d1.Local != d0.Local {
		t.Errorf("%d %s; decode engine %+v: want 200 with the KV read, not recomputed", resp.status, resp.body, d1)
	}
	return r
}

// fullStoreRow: JetStream refuses every new message, as on a full disk:
// PDQ_DECODE is full, and so is PDQ_RELEASE, the queue a refused handoff's
// KV is released through. The client gets its 429; the prefill's KV must
// be released all the same, by a decode worker asked directly.
func fullStoreRow(t *testing.T) row {
	c := startCluster(t, clusterOptions{prefillSim: []string{"--kv-lease", "60s"}})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	ctx := context.Background()
	var fillers []func()
	for _, name := range []string{dispatcher.StreamDecode, dispatcher.StreamRelease} {
		st, err := c.js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		// Full at what it holds now (a stage stream's keeper), with a
		// filler in the room a keeper's renewal needs.
		info, err := st.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cfg := info.Config
		cfg.MaxMsgs = int64(info.State.Msgs) + 1
		if _, err := c.js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		subject := dispatcher.JobSubject(dispatcher.StageDecode, "no-such-pool", "filler")
		if name == dispatcher.StreamRelease {
			subject = dispatcher.ReleaseSubject("no-such-pool", "filler")
		}
		ack, err := c.js.Publish(ctx, subject, []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		fillers = append(fillers, func() { st.DeleteMsg(ctx, ack.Sequence) })
	}
	outs := c.load(2, "fullstore", 0, pd(4, false))
	r := row{scenario: "handoff and its release refused (a full store)"}
	tally(&r, outs)
	held := c.prefill.Stats(t).BlocksHeld
	r.blocksHeld = c.settle(5 * time.Second)
	r.cost = fmt.Sprintf("%d blocks held at the answers", held)
	for _, o := range outs {
		if o.status != http.StatusTooManyRequests {
			t.Errorf("outcome %+v, want 429", o)
		}
	}
	for _, f := range fillers {
		f()
	}
	return r
}
