package tests

import (
	"fmt"
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
	nh, gh := lab.Host("nats"), lab.Host("gw")
	node := natsNode{name: "n1", client: nh.IP + ":4222"}
	startNATSServerOn(t, nh, node, writeNATSConf(t, t.TempDir(), node, nil, ""))
	url := "nats://" + node.client
	nc, js := waitJetStream(t, url)
	c := &cluster{t: t, natsURL: url, nc: nc, js: js}
	c.env = append([]string{"PDQ_NATS_URL=" + url, "PDQ_ACK_WAIT=1s"}, env...)
	c.gateway = startPDQOn(t, gh, append([]string{"PDQ_HTTP_ADDR=" + gh.IP + ":8000"}, c.env...), "gateway")
	c.url = "http://" + c.gateway.waitLog(t, "gateway listening")["addr"].(string)
	return &labCluster{cluster: c, lab: lab, natsHost: nh, gwHost: gh}
}

// labEngine is an engine and its worker, on a host of their own.
type labEngine struct {
	host   *netlab.Host
	engine *simtest.Engine
	worker *process
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
	w := startPDQOn(t, h, append([]string{"PDQ_ENGINE_URL=" + e.URL, fmt.Sprintf("PDQ_ENGINE_SLOTS=%d", slots)}, lc.env...), string(stage))
	w.waitLog(t, "stage worker pulling")
	return labEngine{host: h, engine: e, worker: w}
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

		var outs []outcome
		done := make(chan struct{})
		go func() { outs = lc.load(16, "cut", 0, streamed(100)); close(done) }()
		d1.engine.WaitStats(t, 10*time.Second, "decodes on d1", func(s sim.Stats) bool { return s.Running >= 2 })
		d1.host.Cut()
		time.Sleep(4 * time.Second) // past PDQ_ACK_WAIT
		d1.host.Heal()
		<-done

		r := row{scenario: "a decode worker cut off from NATS for 4 s mid-decode"}
		tally(&r, outs)
		twice := 0
		for i := range 16 {
			id := fmt.Sprintf("cut-%d", i)
			if len(d1.engine.Requests(t, id)) > 0 && len(d2.engine.Requests(t, id)) > 0 {
				twice++
			}
		}
		t.Logf("%s: accepted %d, completed %d, errors %d, lost %d; decoded on both engines: %d; d1 %+v; d2 %+v",
			r.scenario, r.accepted, r.completed, r.errors, r.lost, twice, d1.engine.Stats(t), d2.engine.Stats(t))
		if r.lost != 0 || r.accepted != 16 {
			t.Errorf("accepted %d of 16, lost %d; want 16 accepted, none lost: %+v", r.accepted, r.lost, outs)
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

		var outs []outcome
		done := make(chan struct{})
		go func() { outs = lc.load(8, "pcut", 0, streamed(20)); close(done) }()
		p1.engine.WaitStats(t, 10*time.Second, "prefills on p1", func(s sim.Stats) bool { return s.Running >= 1 })
		p1.host.Cut()
		time.Sleep(4 * time.Second)
		p1.host.Heal()
		<-done

		r := row{scenario: "a prefill worker cut off from NATS for 4 s mid-prefill"}
		tally(&r, outs)
		twice := 0
		for i := range 8 {
			id := fmt.Sprintf("pcut-%d", i)
			if len(p1.engine.Requests(t, id)) > 0 && len(p2.engine.Requests(t, id)) > 0 {
				twice++
			}
		}
		t.Logf("%s: accepted %d, completed %d, errors %d, lost %d; prefilled on both engines: %d; p1 %+v; p2 %+v",
			r.scenario, r.accepted, r.completed, r.errors, r.lost, twice, p1.engine.Stats(t), p2.engine.Stats(t))
		if r.lost != 0 || r.accepted != 8 {
			t.Errorf("accepted %d of 8, lost %d; want 8 accepted, none lost: %+v", r.accepted, r.lost, outs)
		}
	})
}
