package tests

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/tests/netlab"
)

// The tests named TestCluster run pdq across hosts of their own (see
// netlab): NATS, the gateway, and each engine with its worker, each on a
// host with its own address, the test's clients on the machine's own
// namespace. make cluster-test runs them alone; make test beside the
// fault suite.

// labCluster is a cluster whose parts run on a lab's hosts.
type labCluster struct {
	*cluster
	lab      *netlab.Lab
	natsHost *netlab.Host
	gwHost   *netlab.Host
}

// startLabCluster starts a standalone nats-server and the gateway, each
// on a host of its own, with env for every pdq service; engines and
// workers come with engine.
func startLabCluster(t *testing.T, env ...string) *labCluster {
	t.Helper()
	lab := netlab.New(t)
	nh := lab.Host("nats")
	node := natsNode{name: "n1", client: nh.IP + ":4222"}
	startNATSServerOn(t, nh, node, writeNATSConf(t, t.TempDir(), node, nil, ""))
	lc := labSide(t, lab, "nats://"+node.client, "gw", env...)
	lc.natsHost = nh
	return lc
}

// labSide starts a gateway on a new host named gw, joining the NATS at
// natsURL, with env for every pdq service it and the side's engines
// (engine) start with.
func labSide(t *testing.T, lab *netlab.Lab, natsURL, gw string, env ...string) *labCluster {
	t.Helper()
	gh := lab.Host(gw)
	nc, js := waitJetStream(t, natsURL)
	c := &cluster{t: t, natsURL: natsURL, nc: nc, js: js}
	c.env = append([]string{"PDQ_NATS_URL=" + natsURL, "PDQ_ACK_WAIT=1s"}, env...)
	c.gateway = startPDQOn(t, gh, append([]string{"PDQ_HTTP_ADDR=" + gh.IP + ":8000"}, c.env...), "gateway")
	c.url = "http://" + c.gateway.waitLog(t, "gateway listening")["addr"].(string)
	return &labCluster{cluster: c, lab: lab, gwHost: gh}
}

// labEngine is an engine and its worker, on a host of their own.
type labEngine struct {
	host   *netlab.Host
	engine *simtest.Engine
	worker *process
	// metrics is the worker's /metrics URL.
	metrics string
}

// engine starts, on a new host named name, a pdq sim with simArgs and a
// worker of stage for it with slots.
func (lc *labCluster) engine(name string, stage dispatcher.Stage, slots int, simArgs ...string) labEngine {
	t := lc.t
	t.Helper()
	h := lc.lab.Host(name)
	args := append([]string{"sim", "--addr", h.IP + ":0", "--kv-host", h.IP, "--kv-port", "0", "--prefill-overhead", "1ms", "--itl", "0s"}, simArgs...)
	sp := startPDQOn(t, h, nil, args...)
	e := &simtest.Engine{URL: "http://" + sp.waitLog(t, "simulated engine ready")["addr"].(string)}
	w := startPDQOn(t, h, append([]string{"PDQ_ENGINE_URL=" + e.URL, fmt.Sprintf("PDQ_ENGINE_SLOTS=%d", slots),
		"PDQ_METRICS_ADDR=" + h.IP + ":0"}, lc.env...), string(stage))
	metrics := "http://" + w.waitLog(t, "serving metrics")["addr"].(string) + "/metrics"
	w.waitLog(t, "stage worker pulling")
	return labEngine{host: h, engine: e, worker: w, metrics: metrics}
}

// cutFromNATS blackholes the routes between h and the NATS host, both
// ways, until heal: h's worker hears nothing from NATS, while the test's
// process still reaches h's engine.
func (lc *labCluster) cutFromNATS(h *netlab.Host) (heal func()) {
	h.CutFrom(false, lc.natsHost)
	lc.natsHost.CutFrom(false, h)
	return func() {
		h.Heal()
		lc.natsHost.Heal()
	}
}

// leaseLost is the count of pdq_leases_lapsed_total{stage,outcome} on a
// worker's /metrics.
func leaseLost(t *testing.T, e labEngine, stage dispatcher.Stage, outcome string) float64 {
	t.Helper()
	v, _ := metricValue(string(get(t, e.metrics).body), "pdq_leases_lapsed_total",
		fmt.Sprintf("stage=%q", stage), fmt.Sprintf("outcome=%q", outcome))
	return v
}

// TestClusterPartitions cuts hosts off while load runs, and counts from
// the clients' side: every request whose client waited ends in exactly
// one answer, whole or a clear error, and none is lost.
func TestClusterPartitions(t *testing.T) {
	t.Run("a decode worker cut off from NATS mid-decode", func(t *testing.T) {
		// Its engine is on its host (loopback): the decodes it runs go on
		// while its worker hears nothing from NATS, past PDQ_ACK_WAIT.
		lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=5s")
		lc.engine("p", dispatcher.StagePrefill, 4)
		d1 := lc.engine("d1", dispatcher.StageDecode, 8, "--itl", "20ms")
		d2 := lc.engine("d2", dispatcher.StageDecode, 8, "--itl", "20ms")
		lc.ready()

		outs := cutWhile(d1.host, 4*time.Second,
			func() []outcome { return lc.load(16, "cut", 0, streamed(100)) },
			func() {
				d1.engine.WaitStats(t, 10*time.Second, "decodes on d1", func(s sim.Stats) bool { return s.Running >= 2 })
			})

		partitionRow(t, "a decode worker cut off from NATS for 4 s mid-decode", "cut", outs, d1.engine, d2.engine)
	})
	t.Run("a prefill worker cut off past the ack wait, then healed", func(t *testing.T) {
		// Prefills of 10 s; the cut, 3 s, outlasts PDQ_ACK_WAIT (1 s): NATS
		// redelivers the cut-off worker's jobs, and the other engine, with
		// room for them, runs them. Once healed, the worker finds them
		// taken over and stops their engine calls, rather than running
		// them to the end. Without affinity, so that both engines get
		// prompts (they are alike).
		lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=5s", "PDQ_AFFINITY=false")
		p1 := lc.engine("p1", dispatcher.StagePrefill, 4, "--prefill-overhead", "10s")
		p2 := lc.engine("p2", dispatcher.StagePrefill, 8, "--prefill-overhead", "10s")
		lc.engine("d", dispatcher.StageDecode, 16, "--itl", "10ms")
		lc.ready()

		var atCut sim.Stats
		outs := cutWhile(nil, 0,
			func() []outcome { return lc.load(6, "lease", 0, streamed(20)) },
			func() {
				atCut = p1.engine.WaitStats(t, 10*time.Second, "prefills on p1", func(s sim.Stats) bool { return s.Running >= 1 })
				heal := lc.cutFromNATS(p1.host)
				time.Sleep(3 * time.Second)
				heal()
			})
		partitionRow(t, "a prefill worker cut off from NATS for 3 s, past the ack wait, mid-prefill", "lease", outs, p1.engine, p2.engine)
		after := p1.engine.Stats(t)
		stopped := leaseLost(t, p1, dispatcher.StagePrefill, "stopped")
		finished := leaseLost(t, p1, dispatcher.StagePrefill, "finished")
		t.Logf("p1 ran %d prefills at the cut; after: %d aborted by pdq; leases lapsed: %v stopped once back, %v finished", atCut.Running, after.Aborts, stopped, finished)
		if stopped < 1 || float64(after.Aborts) != stopped || finished != 0 {
			t.Errorf("the cut-off worker stopped %v of its prefills as taken over (its engine aborted %d) and finished %v; want at least 1, each aborted, none finished",
				stopped, after.Aborts, finished)
		}
	})
	t.Run("a decode worker cut off past the stall time-out", func(t *testing.T) {
		// Decodes of 8 s; the cut, 7 s, outlasts PDQ_ACK_WAIT and
		// PDQ_STALL_TIMEOUT together (1 + 3 s): NATS has redelivered every
		// job the cut-off worker runs, or the gateway has given up on it,
		// and the worker stops their engine calls while still cut off.
		lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=3s")
		lc.engine("p", dispatcher.StagePrefill, 4)
		d1 := lc.engine("d1", dispatcher.StageDecode, 8, "--itl", "40ms")
		d2 := lc.engine("d2", dispatcher.StageDecode, 8, "--itl", "40ms")
		lc.ready()

		var atCut, cut sim.Stats
		outs := cutWhile(nil, 0,
			func() []outcome { return lc.load(6, "cap", 0, streamed(200)) },
			func() {
				atCut = d1.engine.WaitStats(t, 10*time.Second, "decodes on d1", func(s sim.Stats) bool { return s.Running >= 2 })
				cutAt, heal := time.Now(), lc.cutFromNATS(d1.host)
				defer heal()
				var err error
				cut, err = d1.engine.Poll(6*time.Second, func(s sim.Stats) bool { return s.Running == 0 })
				if err != nil || cut.Aborts < atCut.Running {
					t.Errorf("cut off for 6 s, past its 1 s ack wait and 3 s stall time-out, d1 still runs %d decodes, %d aborted of the %d at the cut (%v)",
						cut.Running, cut.Aborts, atCut.Running, err)
				}
				time.Sleep(time.Until(cutAt.Add(7 * time.Second)))
			})
		partitionRow(t, "a decode worker cut off from NATS for 7 s, past the stall time-out, mid-decode", "cap", outs, d1.engine, d2.engine)
		stopped := leaseLost(t, d1, dispatcher.StageDecode, "cut_off")
		t.Logf("d1 ran %d decodes at the cut; %d aborted while cut off; %v leases given up as cut off", atCut.Running, cut.Aborts, stopped)
		if stopped < float64(atCut.Running) {
			t.Errorf("pdq_leases_lapsed_total{outcome=cut_off} = %v, want the %d decodes running at the cut", stopped, atCut.Running)
		}
	})
	t.Run("a prefill worker cut off from NATS mid-prefill", func(t *testing.T) {
		// Prefills of 2 s: the cut (4 s, past PDQ_ACK_WAIT) comes while
		// the cut-off engine computes, and its answers find no NATS.
		lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=5s")
		p1 := lc.engine("p1", dispatcher.StagePrefill, 4, "--prefill-overhead", "2s")
		p2 := lc.engine("p2", dispatcher.StagePrefill, 4, "--prefill-overhead", "2s")
		lc.engine("d", dispatcher.StageDecode, 16, "--itl", "10ms")
		lc.ready()

		outs := cutWhile(p1.host, 4*time.Second,
			func() []outcome { return lc.load(8, "pcut", 0, streamed(20)) },
			func() {
				p1.engine.WaitStats(t, 10*time.Second, "prefills on p1", func(s sim.Stats) bool { return s.Running >= 1 })
			})

		partitionRow(t, "a prefill worker cut off from NATS for 4 s mid-prefill", "pcut", outs, p1.engine, p2.engine)
	})
	t.Run("a gateway cut off from NATS, its clients still with it", func(t *testing.T) {
		// Routes, not the link: the gateway and the NATS host blackhole
		// each other, and the clients' side still reaches the gateway.
		// Streams in flight lose their replies for 4 s (under the stall
		// time-out, 5 s); requests that come meanwhile cannot be queued.
		lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=5s")
		lc.engine("p", dispatcher.StagePrefill, 4)
		d := lc.engine("d", dispatcher.StageDecode, 16, "--itl", "20ms")
		lc.ready()

		var during []outcome
		outs := cutWhile(nil, 4*time.Second,
			func() []outcome { return lc.load(8, "gcut", 0, streamed(150)) },
			func() {
				d.engine.WaitStats(t, 10*time.Second, "decodes running", func(s sim.Stats) bool { return s.Running >= 4 })
				lc.gwHost.CutFrom(false, lc.natsHost)
				lc.natsHost.CutFrom(false, lc.gwHost)
				// Requests sent while it is cut off: a clear 503, or
				// served once it is back.
				sent := make(chan struct{})
				go func() { during = lc.load(2, "gcut-new", 0, streamed(5)); close(sent) }()
				time.Sleep(4 * time.Second)
				lc.gwHost.Heal()
				lc.natsHost.Heal()
				<-sent
			})
		partitionRow(t, "a gateway cut off from NATS for 4 s, its clients still with it", "gcut", outs, d.engine, nil)
		r := row{}
		tally(&r, during)
		t.Logf("sent while cut off: accepted %d, completed %d, errors %d, lost %d: %+v", r.accepted, r.completed, r.errors, r.lost, during)
		if r.lost != 0 || r.accepted != 2 {
			t.Errorf("requests sent while the gateway was cut off: accepted %d of 2, lost %d", r.accepted, r.lost)
		}
	})
}

// TestClusterOneWay cuts one direction of a host's traffic while load
// runs: a host that still sends, and hears nothing (CutFrom). TCP carries
// on in neither direction for long (what is sent goes unacknowledged),
// so each is a cut, as the connection sees it, that begins a little
// later.
func TestClusterOneWay(t *testing.T) {
	for _, tc := range []struct {
		name string
		// deaf picks the host that hears nothing from the NATS host.
		deaf func(lc *labCluster, d labEngine) *netlab.Host
	}{
		{"a decode worker that hears nothing from NATS", func(_ *labCluster, d labEngine) *netlab.Host { return d.host }},
		{"a gateway that hears nothing from NATS", func(lc *labCluster, _ labEngine) *netlab.Host { return lc.gwHost }},
		{"a NATS server that hears nothing from a decode worker", func(lc *labCluster, _ labEngine) *netlab.Host { return lc.natsHost }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=5s")
			lc.engine("p", dispatcher.StagePrefill, 4)
			d1 := lc.engine("d1", dispatcher.StageDecode, 8, "--itl", "20ms")
			d2 := lc.engine("d2", dispatcher.StageDecode, 8, "--itl", "20ms")
			lc.ready()
			h := tc.deaf(lc, d1)
			outs := cutWhile(nil, 0,
				func() []outcome { return lc.load(12, "oneway", 0, streamed(150)) },
				func() {
					d1.engine.WaitStats(t, 10*time.Second, "decodes on d1", func(s sim.Stats) bool { return s.Running >= 2 })
					if h == lc.natsHost {
						h.CutFrom(false, d1.host)
					} else {
						h.CutFrom(false, lc.natsHost)
					}
					time.Sleep(4 * time.Second)
					h.Heal()
				})
			partitionRow(t, tc.name+", for 4 s", "oneway", outs, d1.engine, d2.engine)
		})
	}
}

// TestClusterClientsCutOff cuts the clients' side off from the gateway
// (the gateway still reaches NATS and the engines): clients that wait get
// their answers once healed; clients that give up meanwhile are gone for
// good, and their engine calls stop once the gateway can tell (its writes
// fail after the heal), well before their end.
func TestClusterClientsCutOff(t *testing.T) {
	lc := startLabCluster(t, "PDQ_STALL_TIMEOUT=5s")
	lc.engine("p", dispatcher.StagePrefill, 4)
	d := lc.engine("d", dispatcher.StageDecode, 16, "--itl", "20ms")
	lc.ready()

	t.Run("clients that wait", func(t *testing.T) {
		outs := cutWhile(nil, 0,
			func() []outcome { return lc.load(8, "ccut", 0, streamed(150)) },
			func() {
				d.engine.WaitStats(t, 10*time.Second, "decodes running", func(s sim.Stats) bool { return s.Running >= 4 })
				lc.gwHost.CutFrom(true)
				time.Sleep(4 * time.Second)
				lc.gwHost.Heal()
			})
		partitionRow(t, "the clients' side cut off from the gateway for 4 s, the clients waiting", "ccut", outs, d.engine, nil)
	})
	t.Run("clients that give up", func(t *testing.T) {
		before := d.engine.Stats(t)
		var outs []outcome
		cutWhile(nil, 0,
			func() []outcome {
				outs = lc.load(6, "cgone", 5*time.Second, streamed(600)) // 12 s each
				return outs
			},
			func() {
				d.engine.WaitStats(t, 10*time.Second, "decodes running", func(s sim.Stats) bool { return s.Running >= 6 })
				lc.gwHost.CutFrom(true)
				time.Sleep(6 * time.Second) // the clients give up meanwhile
				lc.gwHost.Heal()
			})
		r := row{}
		tally(&r, outs)
		after, err := d.engine.Poll(10*time.Second, func(s sim.Stats) bool { return s.Running == 0 })
		t.Logf("the clients' side cut off for 6 s, its 6 clients giving up after 5 s: left %d, lost %d; the engine aborted %d, %d still run (%v)",
			r.left, r.lost, after.Aborts-before.Aborts, after.Running, err)
		if r.left != 6 {
			t.Errorf("%d of 6 clients left; want all: %+v", r.left, outs)
		}
		if got := after.Aborts - before.Aborts; got != 6 || err != nil {
			t.Errorf("the engine aborted %d of the 6 decodes whose clients left, and runs %d; want all stopped before their end: %v",
				got, after.Running, err)
		}
	})
}

// cutWhile runs load, and cuts h off from the lab once busy returns (its
// engine is at work), for d, past PDQ_ACK_WAIT; then heals it, and
// returns load's outcomes once every client has its answer. With h nil,
// busy makes and heals a cut of its own.
func cutWhile(h *netlab.Host, d time.Duration, load func() []outcome, busy func()) []outcome {
	var outs []outcome
	done := make(chan struct{})
	go func() { outs = load(); close(done) }()
	busy()
	if h != nil {
		h.Cut()
		time.Sleep(d)
		h.Heal()
	}
	<-done
	return outs
}

// partitionRow counts a partition's outcomes, requests prefix-0 to
// prefix-<len(outs)-1>, as the fault suite's rows do, and the requests
// both engines of the stage were sent (the work run twice; b nil: one
// engine, none counted); it logs them,
// and fails the test if a request whose client waited was not accepted or
// got no answer.
func partitionRow(t *testing.T, scenario, prefix string, outs []outcome, a, b *simtest.Engine) {
	t.Helper()
	r := row{scenario: scenario}
	tally(&r, outs)
	twice := 0
	for i := range outs {
		id := fmt.Sprintf("%s-%d", prefix, i)
		if b != nil && len(a.Requests(t, id)) > 0 && len(b.Requests(t, id)) > 0 {
			twice++
		}
	}
	t.Logf("%s: accepted %d, completed %d, errors %d, lost %d; sent to both engines: %d; the cut-off engine %+v",
		r.scenario, r.accepted, r.completed, r.errors, r.lost, twice, a.Stats(t))
	if r.lost != 0 || r.accepted != len(outs) {
		t.Errorf("accepted %d of %d, lost %d; want all accepted, none lost: %+v", r.accepted, len(outs), r.lost, outs)
	}
}

// TestClusterLab checks the lab's cuts themselves: a pdq sim on a host
// of its own answers the test's process, and another host's pdq bench,
// and does not while its host is cut off (its link down), or deaf to the
// one asking (CutFrom), and answers again once healed.
func TestClusterLab(t *testing.T) {
	lab := netlab.New(t)
	h, other := lab.Host("sim"), lab.Host("client")
	sp := startPDQOn(t, h, nil, "sim", "--addr", h.IP+":0", "--kv-host", h.IP, "--kv-port", "0")
	base := "http://" + sp.waitLog(t, "simulated engine ready")["addr"].(string)
	client := &http.Client{Timeout: 500 * time.Millisecond}
	// fromTest: the test's process reaches the sim.
	fromTest := func() bool {
		r, err := client.Get(base + "/health")
		if err != nil {
			return false
		}
		r.Body.Close()
		return r.StatusCode == http.StatusOK
	}
	// fromHost: the other host reaches it, a pdq bench of one request
	// there (it fails when its first request does; killed after 5 s).
	fromHost := func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cmd := other.Command(ctx, pdqBinary, "bench", "--base-url", base, "--model", "pdq-sim", "--num-prompts", "1",
			"--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "2")
		return cmd.Run() == nil
	}
	for _, step := range []struct {
		what  string
		do    func()
		reach func() bool
		want  bool
	}{
		{"before any cut", func() {}, fromTest, true},
		{"its link down", h.Cut, fromTest, false},
		{"healed", h.Heal, fromTest, true},
		{"deaf to the test's process", func() { h.CutFrom(true) }, fromTest, false},
		{"healed again", h.Heal, fromTest, true},
		{"from another host", func() {}, fromHost, true},
		{"deaf to that host", func() { h.CutFrom(false, other) }, fromHost, false},
		{"healed from that host", h.Heal, fromHost, true},
	} {
		step.do()
		if got := step.reach(); got != step.want {
			t.Errorf("%s: the sim answers %v, want %v", step.what, got, step.want)
		}
	}
}
