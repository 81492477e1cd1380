package tests

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/tests/netlab"
)

// labNATS is a 3-node NATS cluster on a lab's hosts, with pdq's streams
// and buckets created in 3 replicas.
type labNATS struct {
	nc    *nats.Conn
	js    jetstream.JetStream
	hosts []*netlab.Host
	urls  []string
	// leaders are the nodes' hosts by the stage stream each leads.
	leaders map[string]*netlab.Host
}

// startLabNATS starts the cluster, each node on a host of its own, and
// creates pdq's streams (R3), as pdq's processes would.
func startLabNATS(t *testing.T, lab *netlab.Lab) *labNATS {
	t.Helper()
	ln := &labNATS{leaders: make(map[string]*netlab.Host)}
	nodes := make([]natsNode, 3)
	for i := range nodes {
		h := lab.Host(fmt.Sprintf("n%d", i+1))
		ln.hosts = append(ln.hosts, h)
		nodes[i] = natsNode{name: h.Name, client: h.IP + ":4222", route: h.IP + ":6222"}
		ln.urls = append(ln.urls, "nats://"+nodes[i].client)
	}
	dir := t.TempDir()
	for i, n := range nodes {
		ndir := filepath.Join(dir, n.name)
		if err := os.MkdirAll(ndir, 0o700); err != nil {
			t.Fatal(err)
		}
		startNATSServerOn(t, ln.hosts[i], n, writeNATSConf(t, ndir, n, nodes, ""))
	}
	nc, js := waitJetStream(t, strings.Join(ln.urls, ","))
	ln.nc, ln.js = nc, js
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		err := dispatcher.Ensure(ctx, js, dispatcher.WithReplicas(3))
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("pdq's streams on a 3-node cluster: %v", err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	for _, name := range []string{dispatcher.StreamPrefill, dispatcher.StreamDecode} {
		st, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info := st.CachedInfo()
		for _, h := range ln.hosts {
			if info.Cluster != nil && info.Cluster.Leader == h.Name {
				ln.leaders[name] = h
			}
		}
		if ln.leaders[name] == nil {
			t.Fatalf("stream %s has no leader: %+v", name, info.Cluster)
		}
	}
	return ln
}

// lead makes node h the leader of stream again if another took over
// (pdq's processes starting can move it): it asks the leader to step down
// until h is elected, and reads the leaders again.
func (ln *labNATS) lead(t *testing.T, stream string, h *netlab.Host) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for try := 0; ; try++ {
		st, err := ln.js.Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		for name := range ln.leaders {
			if s, err := ln.js.Stream(ctx, name); err == nil && s.CachedInfo().Cluster != nil {
				for _, o := range ln.hosts {
					if s.CachedInfo().Cluster.Leader == o.Name {
						ln.leaders[name] = o
					}
				}
			}
		}
		if c := st.CachedInfo().Cluster; c != nil && c.Leader == h.Name {
			return
		}
		if try == 10 {
			t.Fatalf("%s: %s not elected its leader in 10 step-downs", stream, h.Name)
		}
		if _, err := ln.nc.Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 5*time.Second); err != nil {
			t.Logf("step-down of %s's leader: %v", stream, err)
		}
		time.Sleep(time.Second)
	}
}

// cutNode cuts node h off from the other nodes, both ways; its own
// clients still reach it. The returned func heals it.
func (ln *labNATS) cutNode(h *netlab.Host) (heal func()) {
	var others []*netlab.Host
	for _, o := range ln.hosts {
		if o != h {
			others = append(others, o)
			o.CutFrom(false, h)
		}
	}
	h.CutFrom(false, others...)
	return func() {
		for _, o := range ln.hosts {
			o.Heal()
		}
	}
}

// urlsBut lists the nodes' URLs but h's.
func (ln *labNATS) urlsBut(h *netlab.Host) string {
	var urls []string
	for i, o := range ln.hosts {
		if o != h {
			urls = append(urls, ln.urls[i])
		}
	}
	return strings.Join(urls, ",")
}

// urlOf is node h's URL.
func (ln *labNATS) urlOf(h *netlab.Host) string {
	for i, o := range ln.hosts {
		if o == h {
			return ln.urls[i]
		}
	}
	return ""
}

// TestClusterNATSPartitions cuts one node of a 3-node NATS cluster off
// from the other two while load runs, with a gateway and a prefill and a
// decode worker on each side: on the majority side, joined to the other
// two nodes; on the minority side, joined to the cut-off node alone (as a
// process whose connection to it stays up would be). Every request whose
// client waited ends in exactly one answer, on both sides.
func TestClusterNATSPartitions(t *testing.T) {
	for _, tc := range []struct {
		name string
		// victim picks the node to cut off.
		victim func(*labNATS) *netlab.Host
		// leader: the victim must still lead the prefill stream at the cut.
		leader bool
	}{
		{"a NATS node that leads no stage stream", func(ln *labNATS) *netlab.Host {
			for _, h := range ln.hosts {
				if h != ln.leaders[dispatcher.StreamPrefill] && h != ln.leaders[dispatcher.StreamDecode] {
					return h
				}
			}
			return nil
		}, false},
		{"the leader of the prefill stream", func(ln *labNATS) *netlab.Host { return ln.leaders[dispatcher.StreamPrefill] }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lab := netlab.New(t)
			ln := startLabNATS(t, lab)
			victim := tc.victim(ln)
			if victim == nil {
				t.Skip("every node leads a stage stream")
			}
			env := []string{"PDQ_NATS_REPLICAS=3", "PDQ_STALL_TIMEOUT=5s"}
			sides := []struct {
				name string
				lc   *labCluster
				pre  labEngine
				dec  labEngine
			}{{name: "majority"}, {name: "minority"}}
			for i, url := range []string{ln.urlsBut(victim), ln.urlOf(victim)} {
				s := &sides[i]
				s.lc = labSide(t, lab, url, "gw"+s.name[:3], env...)
				s.pre = s.lc.engine("p"+s.name[:3], dispatcher.StagePrefill, 4)
				s.dec = s.lc.engine("d"+s.name[:3], dispatcher.StageDecode, 8, "--itl", "20ms")
			}
			for _, s := range sides {
				s.lc.ready()
			}

			outs := make([][]outcome, len(sides))
			during := make([][]outcome, len(sides))
			done := make(chan int, 2*len(sides)) // a failing test leaves none blocked
			for i, s := range sides {
				// Clients wait up to a minute: a request caught by the cut
				// may wait out the stall time-out and a redelivery before
				// its first byte.
				go func() { outs[i] = s.lc.loadWithin(8, "np-"+s.name, time.Minute, streamed(100)); done <- i }()
			}
			for _, s := range sides {
				s.dec.engine.WaitStats(t, 10*time.Second, "decodes on the "+s.name+" side", func(st sim.Stats) bool { return st.Running >= 1 })
			}
			if tc.leader {
				ln.lead(t, dispatcher.StreamPrefill, victim)
			}
			t.Logf("at the cut, %s leads %s", victim.Name, leads(ln, victim))
			heal := ln.cutNode(victim)
			for i, s := range sides {
				go func() { during[i] = s.lc.loadWithin(2, "np-cut-"+s.name, time.Minute, streamed(5)); done <- i }()
			}
			time.Sleep(5 * time.Second)
			heal()
			for range 2 * len(sides) {
				<-done
			}
			for i, s := range sides {
				r := row{}
				tally(&r, outs[i])
				rd := row{}
				tally(&rd, during[i])
				t.Logf("%s side (%s): in flight: accepted %d, completed %d, errors %d, lost %d; sent during the cut: accepted %d, completed %d, errors %d, lost %d",
					s.name, s.lc.natsURL, r.accepted, r.completed, r.errors, r.lost, rd.accepted, rd.completed, rd.errors, rd.lost)
				for _, group := range [][]outcome{outs[i], during[i]} {
					for _, o := range group {
						if !o.ok {
							t.Logf("  not whole: %d %s %q", o.status, o.err, o.tail[max(len(o.tail)-160, 0):])
							break
						}
					}
				}
				// Each id is sent once: a 409 says the gateway took its own
				// claim, stored late across the heal, for another request's.
				for _, o := range append(outs[i], during[i]...) {
					if o.status == http.StatusConflict {
						t.Errorf("%s side: a request sent once answered 409: %q", s.name, o.tail)
					}
				}
				if r.lost != 0 || rd.lost != 0 || r.accepted != len(outs[i]) || rd.accepted != len(during[i]) {
					t.Errorf("%s side: a request lost or not accepted: %+v %+v", s.name, outs[i], during[i])
				}
			}
		})
	}
}

// leads names the stage streams node h leads.
func leads(ln *labNATS, h *netlab.Host) string {
	var l []string
	for name, o := range ln.leaders {
		if o == h {
			l = append(l, name)
		}
	}
	if len(l) == 0 {
		return "none"
	}
	return strings.Join(l, ", ")
}
