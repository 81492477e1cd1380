package tests

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestLifecycleHandoffPublishRetried is issue 6's case 4: with PDQ_DECODE
// full, a prefill's handoff is retried as a publish, never by running the
// prefill again; the client gets a 429 with Retry-After when the stream
// stays full, and the KV is released (through the decode pool's release
// queue); a 200 once there is room.
func TestLifecycleHandoffPublishRetried(t *testing.T) {
	c := startCluster(t, clusterOptions{prefillSim: []string{"--kv-lease", "60s"}})
	prefill := c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	ctx := context.Background()
	st, err := c.js.Stream(ctx, dispatcher.StreamDecode)
	if err != nil {
		t.Fatal(err)
	}
	// Room for the filler alone, beside the stream's keeper: the decode
	// loop made one when c.ready's request went through. A renewal may hold
	// two for a moment, before it purges the older.
	keeper := dispatcher.KeeperSubject(dispatcher.StageDecode)
	var info *jetstream.StreamInfo
	waitUntil(t, "one keeper in "+dispatcher.StreamDecode, func() bool {
		if info, err = st.Info(ctx, jetstream.WithSubjectFilter(keeper)); err != nil {
			t.Fatal(err)
		}
		return info.State.Subjects[keeper] == 1 && info.State.Msgs == 1
	})
	cfg := info.Config
	cfg.MaxMsgs = 2
	if _, err := c.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	// A renewal under way still holds the room for a moment.
	var filler *jetstream.PubAck
	for try := 0; ; try++ {
		if filler, err = c.js.Publish(ctx, dispatcher.JobSubject(dispatcher.StageDecode, "no-such-pool", "filler"), []byte(`{}`)); err == nil {
			break
		}
		if try == 20 {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	p0 := c.prefill.Stats(t)

	r := post(t, c.url+"/v1/completions", "full-a", completionBody(model, longPrompt, body{"max_tokens": 4}))
	r.wantStatus(t, http.StatusTooManyRequests)
	if r.header.Get("Retry-After") == "" {
		t.Error("429 without Retry-After")
	}
	if n := c.prefill.Stats(t).Prefills - p0.Prefills; n != 1 {
		t.Errorf("%d prefills for one request whose handoff could not be stored, want 1", n)
	}
	c.prefill.WaitStats(t, 10*time.Second, "the refused handoff's KV released", func(s sim.Stats) bool { return s.BlocksHeld == 0 })
	if s := c.prefill.Stats(t); s.HoldsExpired != 0 {
		t.Errorf("%d holds expired; the release should have freed them", s.HoldsExpired)
	}

	done := make(chan response, 1)
	go func() {
		r, err := tryPost(c.url+"/v1/completions", "full-b", completionBody(model, longPrompt, body{"max_tokens": 4}))
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	c.prefill.WaitStats(t, 10*time.Second, "the second prefill", func(s sim.Stats) bool { return s.Prefills == p0.Prefills+2 })
	prefill.waitLog(t, "handoff publish failed; retrying") // the stream refused it
	if err := st.DeleteMsg(ctx, filler.Sequence); err != nil {
		t.Fatal(err)
	}
	parseResponse(t, <-done)
	if n := c.prefill.Stats(t).Prefills - p0.Prefills; n != 2 {
		t.Errorf("%d prefills for two requests, want 2: a refused handoff must not re-run its prefill", n)
	}
}

// TestLifecycleCrashedDeliveriesAnswered is issue 6's case 5: a job whose
// deliveries are used up by workers that crash (kill -9) mid-prefill is
// answered and dead-lettered, not left in the queue while its client waits.
func TestLifecycleCrashedDeliveriesAnswered(t *testing.T) {
	// Without the fallback, a long prompt waits for the gateway to see the
	// prefill worker (503 until then) rather than going decode-only.
	c := startCluster(t, clusterOptions{prefillSim: []string{"--prefill-overhead", "3s"}, env: []string{"PDQ_PREFILL_FALLBACK=fail"}})
	c.worker(dispatcher.StageDecode, 2)
	w := c.worker(dispatcher.StagePrefill, 1)
	res := make(chan outcome, 1)
	go func() {
		for { // until the gateway has seen the prefill worker
			o := c.one("crashy", 40*time.Second, completionBody(model, longPrompt, body{"max_tokens": 4}))
			if o.status != http.StatusServiceUnavailable {
				res <- o
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	for i := range config.DefaultMaxDeliver {
		if i > 0 {
			w = c.worker(dispatcher.StagePrefill, 1)
		}
		c.prefill.WaitStats(t, 10*time.Second, fmt.Sprintf("prefill %d running", i+1), func(s sim.Stats) bool { return s.Running == 1 })
		kill9(t, w)
		c.prefill.WaitStats(t, 10*time.Second, "the prefill aborted", func(s sim.Stats) bool { return s.Running == 0 })
	}
	p0 := c.prefill.Stats(t)
	c.worker(dispatcher.StagePrefill, 1)
	o := <-res
	if o.status != http.StatusBadGateway {
		t.Fatalf("outcome %+v, want a 502 once the deliveries are used up", o)
	}
	if n := c.prefill.Stats(t).Requests - p0.Requests; n != 0 {
		t.Errorf("the prefill engine got %d more requests for a job out of deliveries", n)
	}
	if rec := c.record("crashy"); rec.State != dispatcher.StateFailed || rec.Error == nil || !strings.Contains(rec.Error.Message, "deliveries") {
		t.Errorf("record %+v, want failed after its deliveries", rec)
	}
	dlq, err := c.js.Stream(context.Background(), dispatcher.StreamDLQ)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dlq.GetLastMsgForSubject(context.Background(), dispatcher.DLQSubject(dispatcher.PoolName(model), "crashy")); err != nil {
		t.Errorf("no dead letter: %v", err)
	}
}

// TestLifecyclePoolQueueBound checks PDQ_MAX_QUEUE on a stage's queue in
// JetStream: past the bound a pool's requests get a 429 with a
// Retry-After, and nothing queued is dropped. Without the fair queue,
// which would hold them in the gateway (its bound: tests/fairness_test.go);
// the JetStream bound is what several gateways share.
func TestLifecyclePoolQueueBound(t *testing.T) {
	c := startCluster(t, clusterOptions{prefillSim: []string{"--prefill-overhead", "1500ms"}, env: []string{"PDQ_MAX_QUEUE=2", "PDQ_FAIR_QUEUE=false"}})
	c.worker(dispatcher.StagePrefill, 1)
	c.worker(dispatcher.StageDecode, 2)
	c.ready()
	var wg sync.WaitGroup
	outs := make([]outcome, 3)
	for i := range 3 {
		wg.Go(func() {
			outs[i] = c.one(fmt.Sprintf("q-%d", i), 0, completionBody(model, longPrompt, body{"max_tokens": 2}))
		})
	}
	cons, err := c.js.Consumer(context.Background(), dispatcher.StreamPrefill, dispatcher.ConsumerName(dispatcher.StagePrefill, dispatcher.PoolName(model)))
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "two jobs queued behind the running one", func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.NumPending == 2
	})
	time.Sleep(150 * time.Millisecond) // past the gateway's look at the depth
	r := post(t, c.url+"/v1/completions", "q-over", completionBody(model, longPrompt, body{"max_tokens": 2}))
	r.wantStatus(t, http.StatusTooManyRequests)
	if ra := r.header.Get("Retry-After"); ra == "" || ra == "0" {
		t.Errorf("Retry-After %q", ra)
	}
	wg.Wait()
	for i, o := range outs {
		if !o.ok {
			t.Errorf("queued request %d: %+v; nothing queued may be dropped", i, o)
		}
	}
}

// waitUntil polls cond for up to 10 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
