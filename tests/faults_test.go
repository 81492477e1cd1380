package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/nats/embedded"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// cluster is pdq as an operator runs it: a NATS server listening on
// loopback, and the gateway and every worker as its own `pdq` process, so
// that a test can kill -9 any of them. The engines are `pdq sim` processes.
type cluster struct {
	t        *testing.T
	natsURL  string
	nc       *nats.Conn
	js       jetstream.JetStream
	gateway  *process
	url      string // the gateway's base URL
	prefill  *simtest.Engine
	prefillP *process
	decode   *simtest.Engine
	decodeP  *process
	decode2  *simtest.Engine // a second decode engine, for the runs that start one
	env      []string        // every pdq service's environment
	// gatewayEnv is the gateway's own, after env.
	gatewayEnv []string
}

// clusterOptions are the engines' extra flags and the services' extra
// environment.
type clusterOptions struct {
	prefillSim, decodeSim []string
	decodeAddr            string // a fixed address for the decode sim, so it can be restarted
	env                   []string
	gatewayEnv            []string // the gateway's own, after env
}

func startCluster(t *testing.T, o clusterOptions) *cluster {
	t.Helper()
	srv, err := embedded.Start(embedded.Options{DataDir: t.TempDir(), Listen: "127.0.0.1:0"}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, natsURL: srv.ClientURL(), nc: nc, js: js, gatewayEnv: o.gatewayEnv}
	c.env = append([]string{"PDQ_NATS_URL=" + c.natsURL, "PDQ_ACK_WAIT=1s"}, o.env...)
	c.prefillP, c.prefill = startSimProcess(t, o.prefillSim...)
	decodeArgs := o.decodeSim
	if o.decodeAddr != "" {
		decodeArgs = append([]string{"--addr", o.decodeAddr}, decodeArgs...)
	}
	c.decodeP, c.decode = startSimProcess(t, decodeArgs...)
	c.startGateway()
	return c
}

func (c *cluster) startGateway() {
	c.t.Helper()
	c.gateway = startPDQ(c.t, append(append([]string{"PDQ_HTTP_ADDR=127.0.0.1:0"}, c.env...), c.gatewayEnv...), "gateway")
	c.url = "http://" + c.gateway.waitLog(c.t, "gateway listening")["addr"].(string)
}

// worker starts a worker process for the stage's engine.
func (c *cluster) worker(stage dispatcher.Stage, slots int, env ...string) *process {
	c.t.Helper()
	engine := c.prefill
	if stage == dispatcher.StageDecode {
		engine = c.decode
	}
	return c.workerFor(engine, stage, slots, env...)
}

// workerFor starts a worker process of stage for engine.
func (c *cluster) workerFor(engine *simtest.Engine, stage dispatcher.Stage, slots int, env ...string) *process {
	c.t.Helper()
	env = append(append([]string{"PDQ_ENGINE_URL=" + engine.URL, fmt.Sprintf("PDQ_ENGINE_SLOTS=%d", slots)}, c.env...), env...)
	p := startPDQ(c.t, env, string(stage))
	p.waitLog(c.t, "stage worker pulling")
	return p
}

// ready waits until the gateway serves a P/D request.
func (c *cluster) ready() {
	c.t.Helper()
	waitServing(c.t, c.url)
}

// tap subscribes the test's own connection to subject, and returns once
// the server has the subscription: nothing published after is missed.
func (c *cluster) tap(subject string) *nats.Subscription {
	c.t.Helper()
	sub, err := c.nc.SubscribeSync(subject)
	if err != nil {
		c.t.Fatal(err)
	}
	c.flush()
	return sub
}

// flush returns once the server has processed everything this connection
// sent, and so has sent it every message published to its taps before.
func (c *cluster) flush() {
	c.t.Helper()
	if err := c.nc.Flush(); err != nil {
		c.t.Fatal(err)
	}
}

// kill9 ends a process at once, as a crash would.
func kill9(t *testing.T, p *process) {
	t.Helper()
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-p.exited
}

// sigterm stops a process as an orchestrator would, and waits for its exit.
func sigterm(t *testing.T, p *process) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		if p.err != nil {
			t.Errorf("pdq %s exited with %v after SIGTERM", p.name, p.err)
		}
	case <-time.After(40 * time.Second):
		t.Fatalf("pdq %s did not exit within 40s of SIGTERM", p.name)
	}
}

// outcome is what one client got.
type outcome struct {
	status int    // 0 when the client gave up or lost its connection
	err    string // the client's own error
	ok     bool   // a whole, well-formed answer
	// cut means a 200 whose stream or body broke off: no answer, neither
	// whole nor an error.
	cut  bool
	tail string // the answer's last bytes, to say what went wrong
	// retryAfter is the answer's Retry-After header.
	retryAfter string
}

// load sends n requests at once and returns what each client got. Each
// client gives up after giveUp (0: the test timeout).
func (c *cluster) load(n int, idPrefix string, giveUp time.Duration, mk func(i int) body) []outcome {
	out := make([]outcome, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { out[i] = c.one(fmt.Sprintf("%s-%d", idPrefix, i), giveUp, mk(i)) })
	}
	wg.Wait()
	return out
}

// loadWithin is load with clients that wait up to bound for an answer
// (not the test's 20 s): one with none by then is lost.
func (c *cluster) loadWithin(n int, idPrefix string, bound time.Duration, mk func(i int) body) []outcome {
	out := make([]outcome, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			o := c.send(fmt.Sprintf("%s-%d", idPrefix, i), bound, mk(i))
			if o.err != "" && o.status == 0 {
				o.err = "lost: " + o.err
			}
			out[i] = o
		})
	}
	wg.Wait()
	return out
}

// one sends a request and reads its whole answer.
func (c *cluster) one(id string, giveUp time.Duration, b body) outcome {
	o := c.send(id, giveUp, b)
	if giveUp == 0 && o.err != "" && o.status == 0 {
		// The client meant to wait: no answer within the test's bound is a
		// lost request, not a client that left.
		o.err = "lost: " + o.err
	}
	return o
}

func (c *cluster) send(id string, giveUp time.Duration, b body) outcome {
	if giveUp == 0 {
		giveUp = testTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), giveUp)
	defer cancel()
	url := c.url + "/v1/completions"
	if _, ok := b["messages"]; ok {
		url = c.url + "/v1/chat/completions"
	}
	resp, err := send(ctx, url, id, b)
	if err != nil {
		return outcome{err: err.Error()}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	o := outcome{status: resp.StatusCode, tail: string(raw[max(len(raw)-300, 0):]), retryAfter: resp.Header.Get("Retry-After")}
	if err != nil {
		o.err, o.cut = err.Error(), resp.StatusCode == http.StatusOK && ctx.Err() == nil
		return o
	}
	if resp.StatusCode == http.StatusOK {
		if b["stream"] == true {
			done := strings.HasSuffix(string(raw), "data: [DONE]\n\n")
			o.ok = done && !strings.Contains(string(raw), `"error"`)
			o.cut = !done
		} else {
			_, _, err := checkResponse(response{status: resp.StatusCode, body: raw})
			o.ok = err == nil
		}
	}
	return o
}

// row is one line of the fault table.
type row struct {
	scenario          string
	left              int // clients that gave up before or during their answer
	accepted          int // requests whose clients waited for their answer
	completed, errors int // answered whole, answered with an error
	lost              int // accepted, yet no answer
	cancelledCalls    int64
	blocksHeld        int64
	// byLimit says the blocks held are a documented limit's, left to the
	// engine's lease (reliability.md, Limits), not a release pdq missed.
	byLimit             bool
	replayed, replayedN int
	// cost is what the fault cost the clients, e.g. "+320 ms p50"; empty
	// when not measured.
	cost string
}

// tally counts outcomes: a client that gave up itself is not an accepted
// request whose answer was lost.
func tally(r *row, outs []outcome) {
	for _, o := range outs {
		switch {
		case o.ok:
			r.accepted++
			r.completed++
		case strings.HasPrefix(o.err, "lost: "):
			r.accepted++
			r.lost++
		case strings.Contains(o.err, "context deadline exceeded") || strings.Contains(o.err, "context canceled"):
			r.left++ // before or during the answer: no answer is owed
		case o.cut:
			r.accepted++
			r.lost++ // part of an answer is not one
		case o.status != 0:
			r.accepted++
			r.errors++
		default:
			r.accepted++
			r.lost++
		}
	}
}

// settle waits until both engines are idle and their held blocks are
// freed, and returns the blocks still held then.
func (c *cluster) settle(within time.Duration) int64 {
	c.t.Helper()
	idle := func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 }
	c.decode.WaitStats(c.t, within, "the decode engine idle", idle)
	s, err := c.prefill.Poll(within, func(s sim.Stats) bool { return idle(s) && s.BlocksHeld == 0 })
	if err != nil {
		c.t.Errorf("prefill engine: %v", err)
	}
	return s.BlocksHeld
}

// TestFaultSuite breaks a running pdq in the ways issue 6 lists, with real
// processes on loopback, and prints what each run did and what survived.
// For every run: each accepted request ends in exactly one answer, no
// engine works for a request cancelled before it was pulled, and every
// held KV block is freed.
func TestFaultSuite(t *testing.T) {
	if testing.Short() {
		t.Skip("the fault suite runs real processes")
	}
	var rows []row
	var mu sync.Mutex
	add := func(r row) {
		mu.Lock()
		rows = append(rows, r)
		mu.Unlock()
	}
	t.Cleanup(func() {
		var b strings.Builder
		fmt.Fprintf(&b, "\nFault suite (%s)\n", time.Now().Format(time.RFC3339))
		fmt.Fprintf(&b, "| %-56s | %4s | %8s | %9s | %6s | %4s | %19s | %11s | %8s | %-40s |\n",
			"scenario", "left", "accepted", "completed", "errors", "lost", "calls for cancelled", "blocks held", "replayed", "cost to clients")
		fmt.Fprintf(&b, "|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", strings.Repeat("-", 58), strings.Repeat("-", 6), strings.Repeat("-", 10),
			strings.Repeat("-", 11), strings.Repeat("-", 8), strings.Repeat("-", 6), strings.Repeat("-", 21), strings.Repeat("-", 13), strings.Repeat("-", 10), strings.Repeat("-", 42))
		for _, r := range rows {
			replayed := "-"
			if r.replayedN > 0 {
				replayed = fmt.Sprintf("%d/%d", r.replayed, r.replayedN)
			}
			calls := "-" // not measured
			if r.cancelledCalls >= 0 {
				calls = fmt.Sprint(r.cancelledCalls)
			}
			cost := r.cost
			if cost == "" {
				cost = "-"
			}
			fmt.Fprintf(&b, "| %-56s | %4d | %8d | %9d | %6d | %4d | %19s | %11d | %8s | %-40s |\n",
				r.scenario, r.left, r.accepted, r.completed, r.errors, r.lost, calls, r.blocksHeld, replayed, cost)
		}
		fmt.Fprint(os.Stdout, b.String())
	})
	check := func(t *testing.T, r row) {
		t.Helper()
		if r.lost != 0 || (r.blocksHeld != 0 && !r.byLimit) || r.cancelledCalls > 0 || r.accepted != r.completed+r.errors {
			t.Errorf("%+v: want 0 lost, 0 blocks held, 0 calls for cancelled requests", r)
		}
		add(r)
	}

	t.Run("kill -9 of a prefill worker mid-prefill", func(t *testing.T) {
		c := startCluster(t, clusterOptions{prefillSim: []string{"--prefill-overhead", "1500ms"}})
		a := c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 8)
		c.ready()
		c.worker(dispatcher.StagePrefill, 2)
		var outs []outcome
		done := make(chan struct{})
		go func() { outs = c.load(4, "kp", 0, pd(8, false)); close(done) }()
		c.prefill.WaitStats(t, 10*time.Second, "prefills running", func(s sim.Stats) bool { return s.Running >= 3 })
		kill9(t, a)
		<-done
		r := row{scenario: "kill -9 prefill worker mid-prefill"}
		tally(&r, outs)
		r.blocksHeld = c.settle(10 * time.Second)
		if r.completed != 4 {
			t.Errorf("outcomes %+v, want 4 completed", outs)
		}
		check(t, r)
	})

	t.Run("kill -9 of a decode worker before its first token", func(t *testing.T) {
		c := startCluster(t, clusterOptions{prefillSim: []string{"--kv-lease", "60s"}})
		c.worker(dispatcher.StagePrefill, 2)
		a := c.worker(dispatcher.StageDecode, 4)
		c.ready()
		setFault(t, c.decode, `{"rate":1,"kind":"slow","delay":"2s"}`)
		before, p0 := c.decode.Stats(t), c.prefill.Stats(t)
		var outs []outcome
		done := make(chan struct{})
		go func() { outs = c.load(3, "kd", 0, pd(8, true)); close(done) }()
		// The engine draws a request's fault after reading it: counted
		// faults are slow decodes begun, counted requests might not be.
		c.decode.WaitStats(t, 10*time.Second, "decodes started", func(s sim.Stats) bool { return s.Faults >= before.Faults+3 })
		kill9(t, a)
		setFault(t, c.decode, `{"rate":0}`)
		c.worker(dispatcher.StageDecode, 4)
		<-done
		r := row{scenario: "kill -9 decode worker before first token"}
		tally(&r, outs)
		r.blocksHeld = c.settle(10 * time.Second)
		if s := c.decode.Stats(t); r.completed != 3 || s.KVReadFailures != 0 || s.Recomputes != 0 {
			t.Errorf("outcomes %+v, decode stats %+v: want 3 completed, no KV read failure or recompute", outs, s)
		}
		// Each request was prefilled again as generation 2: a redelivered
		// handoff's KV may have been read.
		if p1 := c.prefill.Stats(t); p1.Prefills-p0.Prefills != 6 {
			t.Errorf("%d prefills, want 6 (3 requests, 2 generations each)", p1.Prefills-p0.Prefills)
		}
		for i := range 3 {
			if rec := c.record(fmt.Sprintf("kd-%d", i)); rec.State != dispatcher.StateDone || rec.Generation != 2 {
				t.Errorf("record %+v, want done in generation 2", rec)
			}
		}
		check(t, r)
	})

	t.Run("SIGTERM of workers mid-job", func(t *testing.T) {
		c := startCluster(t, clusterOptions{prefillSim: []string{"--prefill-overhead", "800ms"}, decodeSim: []string{"--itl", "20ms"}})
		p := c.worker(dispatcher.StagePrefill, 2)
		d := c.worker(dispatcher.StageDecode, 4)
		c.ready()
		var outs []outcome
		done := make(chan struct{})
		go func() { outs = c.load(4, "st", 0, pd(40, true)); close(done) }()
		c.prefill.WaitStats(t, 10*time.Second, "prefills running", func(s sim.Stats) bool { return s.Running >= 2 })
		c.worker(dispatcher.StagePrefill, 2)
		sigterm(t, p)
		c.decode.WaitStats(t, 10*time.Second, "decodes running", func(s sim.Stats) bool { return s.Running >= 1 })
		c.worker(dispatcher.StageDecode, 4)
		sigterm(t, d)
		<-done
		r := row{scenario: "SIGTERM of prefill and decode workers mid-job"}
		tally(&r, outs)
		r.blocksHeld = c.settle(10 * time.Second)
		if r.completed != 4 {
			t.Errorf("outcomes %+v, want 4 completed", outs)
		}
		check(t, r)
	})

	t.Run("kill -9 of the gateway", func(t *testing.T) {
		c := startCluster(t, clusterOptions{prefillSim: []string{"--kv-lease", "60s"}, decodeSim: []string{"--itl", "50ms"}})
		c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 2)
		c.ready()
		before := c.decode.Stats(t)
		var outs []outcome
		done := make(chan struct{})
		// 2 streams decode, 2 wait as handoffs behind them.
		go func() { outs = c.load(4, "kg", 0, pd(200, true)); close(done) }()
		c.decode.WaitStats(t, 10*time.Second, "decodes running", func(s sim.Stats) bool { return s.Running >= 2 })
		c.prefill.WaitStats(t, 10*time.Second, "every prefill done", func(s sim.Stats) bool { return s.Prefills >= 5 })
		kill9(t, c.gateway)
		<-done
		s := c.decode.WaitStats(t, 15*time.Second, "the decodes stopped", func(s sim.Stats) bool { return s.Running == 0 })
		// A stream that ran to its end has 200 tokens; a KV release, 1.
		r := row{scenario: "kill -9 of the gateway; clients retry the ids", cancelledCalls: (s.GenerationTokens - before.GenerationTokens) / 200}
		for _, o := range outs {
			if o.ok {
				t.Errorf("a client of the killed gateway got a whole answer: %+v", o)
			}
		}
		r.blocksHeld = c.settle(15 * time.Second)
		// Their clients saw the connection drop; retried under the same ids
		// through a new gateway, they are answered.
		c.startGateway()
		retry := c.load(4, "kg", 0, pd(4, false))
		tally(&r, retry)
		if r.completed != 4 {
			t.Errorf("retries %+v, want 4 completed", retry)
		}
		check(t, r)
	})

	t.Run("clients that leave at every stage", func(t *testing.T) {
		c := startCluster(t, clusterOptions{prefillSim: []string{"--prefill-overhead", "600ms", "--kv-lease", "60s"},
			decodeSim: []string{"--max-num-seqs", "1", "--itl", "40ms"}})
		c.worker(dispatcher.StagePrefill, 1)
		c.worker(dispatcher.StageDecode, 1)
		c.ready()
		p0, d0 := c.prefill.Stats(t), c.decode.Stats(t)
		var wg sync.WaitGroup
		var outs [4]outcome
		// Prefilling: its client leaves in the middle of a 600 ms prefill.
		// Queued: behind it on the only prefill slot; its client leaves
		// first.
		wg.Go(func() { outs[0] = c.one("leave-prefilling", 300*time.Millisecond, pd(4, false)(0)) })
		time.Sleep(50 * time.Millisecond)
		wg.Go(func() { outs[1] = c.one("leave-queued", 200*time.Millisecond, pd(4, false)(0)) })
		wg.Wait()
		// Decoding: a long stream whose client leaves after 3 s; it holds
		// the only decode slot meanwhile. Waiting as a handoff: prefilled,
		// then its client leaves while the decode slot is busy.
		wg.Go(func() { outs[2] = c.one("leave-decoding", 3*time.Second, pd(100, true)(0)) })
		c.decode.WaitStats(t, 10*time.Second, "the long decode", func(s sim.Stats) bool { return s.Running == 1 })
		wg.Go(func() { outs[3] = c.one("leave-handoff", 900*time.Millisecond, pd(4, false)(0)) })
		wg.Wait()
		r := row{scenario: "clients leave: queued, prefilling, handoff, decoding"}
		tally(&r, outs[:])
		r.blocksHeld = c.settle(10 * time.Second)
		p1, d1 := c.prefill.Stats(t), c.decode.Stats(t)
		// The queued request never reached an engine; the one prefilling
		// was aborted; the long decode was aborted, not finished; the
		// handoff's KV was released with a one-token call (the lease is
		// 60 s, so nothing else freed it).
		if n := p1.Requests - p0.Requests; n != 3 {
			t.Errorf("prefill engine got %d requests, want 3 (the queued request must not reach it)", n)
			r.cancelledCalls += max(n-3, 0)
		}
		if p1.Aborts-p0.Aborts != 1 {
			t.Errorf("prefill engine aborted %d requests, want the one prefilling", p1.Aborts-p0.Aborts)
		}
		if n := d1.Decodes - d0.Decodes; n != 1 || d1.GenerationTokens-d0.GenerationTokens != 1 || d1.Aborts-d0.Aborts != 1 {
			t.Errorf("decode engine: %+v before, %+v after: want the stream aborted and only the one-token release finished", d0, d1)
			r.cancelledCalls += max(n-1, 0)
		}
		// The decode worker counts the release in its registry entry.
		waitUntil(t, "the release counted in the registry", func() bool {
			kv, err := c.js.KeyValue(context.Background(), dispatcher.BucketWorkers)
			if err != nil {
				return false
			}
			keys, _ := kv.Keys(context.Background())
			for _, k := range keys {
				e, err := kv.Get(context.Background(), k)
				var w dispatcher.WorkerInfo
				if err == nil && json.Unmarshal(e.Value(), &w) == nil && w.Role == dispatcher.StageDecode && w.KVReleased == 1 {
					return true
				}
			}
			return false
		})
		for _, id := range []string{"leave-decoding", "leave-handoff", "leave-prefilling", "leave-queued"} {
			if st := c.state(id); st != dispatcher.StateCancelled {
				t.Errorf("%s: state %s, want cancelled", id, st)
			}
		}
		// The gateway ends the record as its client leaves; the worker
		// that stops adds the stage runs it stopped in.
		for id, stages := range map[string][]dispatcher.Stage{
			"leave-decoding":   {dispatcher.StagePrefill, dispatcher.StageDecode},
			"leave-prefilling": {dispatcher.StagePrefill},
		} {
			waitUntil(t, id+"'s record has its stage runs", func() bool {
				var got []dispatcher.Stage
				for _, s := range c.record(id).Stages {
					got = append(got, s.Stage)
				}
				return slices.Equal(got, stages)
			})
		}
		check(t, r)
	})

	t.Run("a burst of 20x capacity from clients with short time-outs", func(t *testing.T) {
		c := startCluster(t, clusterOptions{decodeSim: []string{"--max-num-seqs", "2", "--itl", "20ms"}})
		c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 2)
		c.ready()
		d0 := c.decode.Stats(t)
		// Short prompts go decode-only: every engine call is then one the
		// counters can tell apart (no KV releases among them).
		outs := c.load(80, "burst", time.Second, func(int) body {
			return completionBody(model, "Hi there", body{"max_tokens": 20, "ignore_eos": true, "stream": true})
		})
		r := row{scenario: "burst of 20x capacity, 1 s client time-outs"}
		tally(&r, outs)
		r.blocksHeld = c.settle(15 * time.Second)
		d1 := c.decode.Stats(t)
		// Calls beyond the answers and the two slots' jobs running when
		// their clients left went to requests cancelled before their pull.
		const slots = 2
		r.cancelledCalls = max(d1.Requests-d0.Requests-int64(r.completed)-2*slots, 0)
		if r.completed == 0 || r.completed == len(outs) {
			t.Errorf("%d of %d completed: the burst did not overload pdq", r.completed, len(outs))
		}
		check(t, r)
	})

	t.Run("a P/D burst of 20x capacity from clients with short time-outs", func(t *testing.T) {
		c := startCluster(t, clusterOptions{prefillSim: []string{"--prefill-overhead", "20ms"},
			decodeSim: []string{"--max-num-seqs", "2", "--itl", "20ms"}})
		c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 2)
		c.ready()
		outs := c.load(80, "pdburst", time.Second, pd(20, true))
		// With the default 30 s lease, held blocks are freed within the
		// settle only by reads and releases.
		r := row{scenario: "P/D burst of 20x capacity, 1 s client time-outs", cancelledCalls: -1}
		tally(&r, outs)
		r.blocksHeld = c.settle(15 * time.Second)
		if s := c.decode.Stats(t); s.KVReadFailures != 0 || s.EngineDead {
			t.Errorf("decode engine %+v: want no KV read failure", s)
		}
		if r.completed == 0 || r.completed == len(outs) {
			t.Errorf("%d of %d completed: the burst did not overload pdq", r.completed, len(outs))
		}
		check(t, r)
	})

	t.Run("a dead decode engine, then pdq replay --failed", func(t *testing.T) {
		addr := freeAddr(t)
		// A handoff waits for its decode engine while its KV lasts
		// (PDQ_KV_TTL, under the 2 s lease here), then is prefilled again,
		// in 2 generations: an engine dead for good fails the requests.
		c := startCluster(t, clusterOptions{decodeAddr: addr, prefillSim: []string{"--kv-lease", "2s"},
			env: []string{"PDQ_MAX_GENERATIONS=2", "PDQ_KV_TTL=1500ms"}})
		c.worker(dispatcher.StagePrefill, 2)
		dw := c.worker(dispatcher.StageDecode, 4, "PDQ_METRICS_ADDR=127.0.0.1:0")
		metricsURL := "http://" + dw.waitLog(t, "serving metrics")["addr"].(string) + "/metrics"
		c.ready()
		kill9(t, c.decodeP)
		outs := c.load(3, "dead", 0, pd(6, false))
		r := row{scenario: "dead decode engine; replay after restart"}
		tally(&r, outs)
		for _, o := range outs {
			if o.status != http.StatusBadGateway {
				t.Errorf("outcome %+v, want 502", o)
			}
		}
		if m := get(t, metricsURL); !strings.Contains(string(m.body), `pdq_dead_letters_total{stage="decode"} 3`) {
			t.Errorf("the decode worker's /metrics does not count the 3 dead letters:\n%s", m.body)
		}
		c.decodeP, c.decode = startSimProcess(t, "--addr", addr)
		r.blocksHeld = c.settle(10 * time.Second)
		replay := c.replay("--failed")
		r.replayedN = 3
		for i := range 3 {
			rec := c.record(fmt.Sprintf("dead-%d", i))
			if rec.State == dispatcher.StateDone && len(rec.Result) > 0 {
				r.replayed++
			} else {
				t.Errorf("replayed record %+v, want done with a result", rec)
			}
		}
		if replay.err != nil {
			t.Errorf("pdq replay: %v\n%s", replay.err, replay.stdout.String())
		}
		check(t, r)
	})

	t.Run("a dead prefill engine", func(t *testing.T) { check(t, deadPrefillRow(t)) })
	t.Run("a hung decode engine", func(t *testing.T) { check(t, hungDecodeRow(t)) })
	t.Run("a decode engine killed mid-stream", func(t *testing.T) { check(t, migrationRow(t)) })
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		t.Run("engine faults at rate 0.3 on "+string(stage), func(t *testing.T) {
			for _, r := range engineFaultRows(t, stage) {
				check(t, r)
			}
		})
	}
	t.Run("kill -9 and restart of a standalone nats-server", func(t *testing.T) { check(t, natsRestartScenario(t)) })
	t.Run("a NATS outage of 20 s", func(t *testing.T) { check(t, natsOutageScenario(t, 20*time.Second)) })
	for _, down := range []time.Duration{3 * time.Second, 20 * time.Second} {
		t.Run(fmt.Sprintf("NATS down %v under load", down), func(t *testing.T) { check(t, natsRestartUnderLoad(t, down)) })
	}
	t.Run("a cold 3-node cluster", func(t *testing.T) { check(t, coldClusterRow(t)) })
	t.Run("a burst past the KV lease", func(t *testing.T) { check(t, burstRow(t)) })
	t.Run("a full JetStream disk", func(t *testing.T) { check(t, fullDiskRow(t)) })
	t.Run("kill -9 of the stream leader of a 3-node cluster", func(t *testing.T) { check(t, natsLeaderKillScenario(t)) })
	t.Run("kill -9 of a decode worker mid-stream", func(t *testing.T) { check(t, killedDecodeWorkerRow(t)) })
	t.Run("the longest prompt", func(t *testing.T) { check(t, longPromptRow(t)) })
	t.Run("lost cancels", func(t *testing.T) { check(t, lostCancelRow(t)) })
	t.Run("a decode engine's blip", func(t *testing.T) {
		for _, r := range decodeBlipRows(t) {
			check(t, r)
		}
	})
	t.Run("KV released by pdq", func(t *testing.T) {
		for _, r := range kvReleaseRows(t) {
			check(t, r)
		}
		check(t, fullStoreRow(t))
	})
}

// replay runs `pdq replay <args> --wait` against the cluster's NATS and
// returns the process once it has exited (within 30 s).
func (c *cluster) replay(args ...string) *process {
	c.t.Helper()
	p := startPDQ(c.t, []string{"PDQ_NATS_URL=" + c.natsURL}, append(append([]string{"replay"}, args...), "--wait")...)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		c.t.Fatalf("pdq replay %v --wait did not finish in 30s", args)
	}
	return p
}

// record reads a request's record through the gateway's API.
func (c *cluster) record(id string) dispatcher.Record {
	c.t.Helper()
	r := get(c.t, c.url+"/v1/requests/"+id)
	var rec dispatcher.Record
	if r.status == http.StatusOK {
		if err := json.Unmarshal(r.body, &rec); err != nil {
			c.t.Fatal(err)
		}
	}
	return rec
}

// state waits for a request's record to end and returns its state.
func (c *cluster) state(id string) dispatcher.State {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rec := c.record(id)
		if rec.State.Ended() || time.Now().After(deadline) {
			return rec.State
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freeAddr returns a loopback address that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
