package tests

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// timed is what one client got, and how long it took.
type timed struct {
	outcome
	took time.Duration
	end  time.Time
}

// timedLoad sends n requests at once, each meaning to wait for its answer,
// and times them.
func (c *cluster) timedLoad(n int, idPrefix string, mk func(i int) body) []timed {
	return c.wave(n, 0, idPrefix, mk, -1, nil)
}

func outcomes(ts ...[]timed) []outcome {
	var out []outcome
	for _, l := range ts {
		for _, t := range l {
			out = append(out, t.outcome)
		}
	}
	return out
}

// longest is the longest time a client of ts waited.
func longest(ts []timed) time.Duration {
	var d time.Duration
	for _, t := range ts {
		d = max(d, t.took)
	}
	return d
}

// median is the median time the clients of ts waited.
func median(ts []timed) time.Duration {
	ds := make([]time.Duration, 0, len(ts))
	for _, t := range ts {
		ds = append(ds, t.took)
	}
	slices.Sort(ds)
	if len(ds) == 0 {
		return 0
	}
	return ds[len(ds)/2]
}

// readyStatus is the gateway's /ready status, 0 when it does not answer.
func readyStatus(url string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/ready", nil)
	if err != nil {
		return 0
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// waitReady polls /ready until it answers want, and reports when it did.
func waitReady(t *testing.T, url string, want int, within time.Duration) time.Time {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got := readyStatus(url)
		if got == want {
			return time.Now()
		}
		if time.Now().After(deadline) {
			t.Fatalf("/ready answered %d, not %d, for %v", got, want, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func streamed(tokens int) func(int) body {
	return func(int) body {
		return completionBody(model, longPrompt, body{"max_tokens": tokens, "ignore_eos": true, "stream": true})
	}
}

func answered(tokens int) func(int) body {
	return func(int) body {
		return completionBody(model, longPrompt, body{"max_tokens": tokens, "ignore_eos": true})
	}
}

// natsStallTimeout is the gateway's PDQ_STALL_TIMEOUT in the NATS runs.
const natsStallTimeout = 5 * time.Second

// standaloneNATS starts a standalone nats-server (file storage) and pdq on
// it: 4 prefill slots, 16 decode slots, a decode engine at 50 ms a token,
// and the gateway's stall time-out at natsStallTimeout.
func standaloneNATS(t *testing.T) (*natsServer, *cluster) {
	dir := t.TempDir()
	node := natsNode{name: "standalone", client: freeAddr(t)}
	ns := startNATSServer(t, node, writeNATSConf(t, dir, node, nil, ""))
	c := startClusterOn(t, ns.url, clusterOptions{decodeSim: []string{"--itl", "50ms"},
		env: []string{fmt.Sprintf("PDQ_STALL_TIMEOUT=%v", natsStallTimeout)}})
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 16)
	c.ready()
	return ns, c
}

// natsRestartScenario kills a standalone nats-server (file storage) with
// -9 while streams run, and starts it again 3 s later on the same port and
// store. Every stream must complete or end with an error (the gateway's
// stall time-out is 5 s), /ready must say 503 while NATS is down and 200
// after, and new requests must be served, also once every registry entry
// from before the restart has aged past its liveness window.
func natsRestartScenario(t *testing.T) row {
	ns, c := standaloneNATS(t)

	r := row{scenario: "kill -9 and restart of a standalone nats-server"}
	base := c.timedLoad(4, "nrb", streamed(60))
	for _, o := range base {
		if !o.ok {
			t.Errorf("before the fault: %+v", o)
		}
	}

	var during []timed
	done := make(chan struct{})
	go func() { during = c.timedLoad(12, "nr", streamed(60)); close(done) }()
	c.decode.WaitStats(t, 10*time.Second, "streams running", func(s sim.Stats) bool { return s.Running >= 8 })
	time.Sleep(500 * time.Millisecond)
	ns.kill9()
	killed := time.Now()
	waitReady(t, c.url, http.StatusServiceUnavailable, 5*time.Second)
	var whileDown []timed
	downDone := make(chan struct{})
	go func() { whileDown = c.timedLoad(2, "nrd", answered(4)); close(downDone) }()
	<-downDone // answered while NATS is down, not after it is back
	time.Sleep(3*time.Second - time.Since(killed))
	ns.start()
	restarted := time.Now()
	readyAt := waitReady(t, c.url, http.StatusOK, 20*time.Second)

	// From the moment /ready says 200, requests are served: at once, and
	// after every registry entry written before the kill has aged past the
	// liveness window (the old registry then refused all with a 503).
	after := c.timedLoad(8, "nra", answered(4))
	servedAt := time.Time{}
	for _, o := range after {
		if !o.ok {
			t.Errorf("a request after /ready said 200: %+v", o)
		} else if servedAt.IsZero() || o.end.Before(servedAt) {
			servedAt = o.end
		}
	}
	time.Sleep(time.Until(killed.Add(dispatcher.LiveFor + 2*dispatcher.HeartbeatInterval)))
	later := c.timedLoad(8, "nrl", answered(4))
	for _, o := range later {
		if !o.ok {
			t.Errorf("a request %v after the kill: %+v", time.Since(killed).Round(time.Second), o)
		}
	}
	<-done
	for i, o := range whileDown {
		if o.status != http.StatusServiceUnavailable || o.retryAfter == "" {
			t.Errorf("nrd-%d, sent while NATS was down: %+v; want a 503 with Retry-After", i, o.outcome)
		}
	}
	// Every stream ends, whole or with an error, within the stall
	// time-out of NATS coming back (plus a stream's own time and a margin
	// for a loaded machine): none hangs past it.
	endBy := restarted.Add(natsStallTimeout + median(base) + 3*time.Second)
	for i, o := range during {
		if o.end.After(endBy) {
			t.Errorf("stream nr-%d ended %v after NATS came back (%+v); want within the %v stall time-out",
				i, o.end.Sub(restarted).Round(time.Millisecond), o.outcome, natsStallTimeout)
		}
	}
	tally(&r, outcomes(during, whileDown, after, later))
	r.blocksHeld = c.settle(15 * time.Second)
	stall := longest(during) - median(base)
	t.Logf("NATS down %v; /ready 200 %v after the restart; first answer %v after it; longest stream %v (%v before the fault)",
		restarted.Sub(killed).Round(time.Millisecond), readyAt.Sub(restarted).Round(time.Millisecond),
		servedAt.Sub(restarted).Round(time.Millisecond), longest(during).Round(time.Millisecond), median(base).Round(time.Millisecond))
	r.cost = fmt.Sprintf("+%d ms longest stream; ready %d ms after restart", stall.Milliseconds(), readyAt.Sub(restarted).Milliseconds())
	for _, g := range []struct {
		name string
		ts   []timed
	}{{"streams in flight", during}, {"sent while NATS was down", whileDown}, {"sent once /ready said 200", after}, {"sent later", later}} {
		var gr row
		tally(&gr, outcomes(g.ts))
		t.Logf("%s: %d completed, %d errors, %d lost; longest %v", g.name, gr.completed, gr.errors, gr.lost, longest(g.ts).Round(time.Millisecond))
		for _, o := range g.ts {
			if !o.ok {
				t.Logf("  not whole: status %d %s; ends %q", o.status, o.err, o.tail)
				break
			}
		}
	}
	return r
}

// wave sends n requests, one every gap, each meaning to wait for its
// answer; after the one numbered at it calls during (once, in its own
// goroutine's stead: the wave goes on meanwhile).
func (c *cluster) wave(n int, gap time.Duration, idPrefix string, mk func(int) body, at int, during func()) []timed {
	out := make([]timed, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			start := time.Now()
			o := c.one(fmt.Sprintf("%s-%d", idPrefix, i), 0, mk(i))
			if o.err != "" && !strings.HasPrefix(o.err, "lost: ") {
				// These clients mean to wait: a stream that stops short of
				// its end within the test's bound is lost too.
				o.err = "lost: " + o.err
			}
			out[i] = timed{outcome: o, took: time.Since(start), end: time.Now()}
		})
		if i == at && during != nil {
			wg.Go(during)
		}
		time.Sleep(gap)
	}
	wg.Wait()
	return out
}

// natsLeaderKillScenario runs pdq on a 3-node NATS cluster on loopback
// (nats-server processes, file storage) with PDQ_NATS_REPLICAS=3, and
// kills the node that leads PDQ_PREFILL with -9 while requests stream in:
// no accepted request may be lost. The cost is the longest request's extra
// time over the median of the same load before the kill.
func natsLeaderKillScenario(t *testing.T) row {
	dir := t.TempDir()
	nodes := make([]natsNode, 3)
	for i := range nodes {
		nodes[i] = natsNode{name: fmt.Sprintf("n%d", i+1), client: freeAddr(t), route: freeAddr(t)}
	}
	servers := make(map[string]*natsServer)
	var urls []string
	for _, n := range nodes {
		ndir := filepath.Join(dir, n.name)
		if err := os.MkdirAll(ndir, 0o700); err != nil {
			t.Fatal(err)
		}
		servers[n.name] = startNATSServer(t, n, writeNATSConf(t, ndir, n, nodes, ""))
		urls = append(urls, "nats://"+n.client)
	}
	c := startClusterOn(t, strings.Join(urls, ","), clusterOptions{decodeSim: []string{"--itl", "20ms"},
		env: []string{"PDQ_NATS_REPLICAS=3", fmt.Sprintf("PDQ_STALL_TIMEOUT=%v", natsStallTimeout)}})
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 8)
	c.ready()

	ctx := context.Background()
	leaders := make(map[string]string)
	for _, name := range []string{dispatcher.StreamPrefill, dispatcher.StreamDecode} {
		st, err := c.js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info := st.CachedInfo()
		if info.Config.Replicas != 3 || info.Cluster == nil || len(info.Cluster.Replicas) != 2 {
			t.Fatalf("stream %s: %d replicas, cluster %+v; want 3", name, info.Config.Replicas, info.Cluster)
		}
		leaders[name] = info.Cluster.Leader
	}
	r := row{scenario: "kill -9 of the R3 stream leader of a 3-node cluster"}
	base := c.wave(10, 100*time.Millisecond, "lkb", streamed(20), -1, nil)
	for _, o := range base {
		if !o.ok {
			t.Errorf("before the fault: %+v", o)
		}
	}
	victim := servers[leaders[dispatcher.StreamPrefill]]
	fault := c.wave(20, 100*time.Millisecond, "lk", streamed(20), 4, victim.kill9)
	tally(&r, outcomes(fault))
	r.blocksHeld = c.settle(15 * time.Second)
	stall := longest(fault) - median(base)
	t.Logf("killed %s, leader of %s (%s led by %s); longest request %v, median before %v",
		victim.name, dispatcher.StreamPrefill, dispatcher.StreamDecode, leaders[dispatcher.StreamDecode],
		longest(fault).Round(time.Millisecond), median(base).Round(time.Millisecond))
	for i, o := range fault {
		if !o.ok {
			t.Logf("request lk-%d: %+v after %v", i, o.outcome, o.took.Round(time.Millisecond))
			for _, l := range strings.Split(c.gateway.output(), "\n") {
				if strings.Contains(l, fmt.Sprintf(`"lk-%d"`, i)) && !strings.Contains(l, "DEBUG") {
					t.Log(l)
				}
			}
		}
	}
	if os.Getenv("PDQ_TEST_LOG") != "" {
		for i, o := range fault {
			t.Logf("lk-%d took %v, ended %s", i, o.took.Round(time.Millisecond), o.end.Format("15:04:05.000"))
		}
		for _, s := range servers {
			t.Logf("%s:\n%s", s.name, s.output())
		}
		for _, p := range []*process{c.gateway} {
			t.Logf("gateway:\n%s", p.output())
		}
	}
	r.cost = fmt.Sprintf("stall +%d ms (p50 %d ms before)", stall.Milliseconds(), median(base).Milliseconds())
	return r
}
