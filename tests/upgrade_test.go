package tests

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
)

// pdqNextBin is pdq built with -tags pdqnext: it writes its jobs one
// envelope version higher (see dispatcher/envelope_next.go), as the next
// build would.
var pdqNextBin builtBinary

func pdqNextBinary(t *testing.T) string {
	t.Helper()
	return pdqNextBin.get(t, "pdq-next", "-tags", "pdqnext", "github.com/pdq-dev/pdq/cmd/pdq")
}

// startPDQNext is startPDQ with the next build.
func startPDQNext(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	return startPDQCmd(t, exec.Command(pdqNextBinary(t), args...), env, append([]string{"(next)"}, args...))
}

// stop ends the server as an orchestrator would (SIGTERM), and waits.
func (s *natsServer) stop() {
	s.t.Helper()
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		s.t.Fatalf("nats-server %s did not exit within 30s of SIGTERM", s.name)
	}
}

// waitCurrent waits until every replica of pdq's stage streams is current,
// node name's among them: a restarted node has caught up.
func waitCurrent(t *testing.T, js jetstream.JetStream, name string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ok := true
		for _, stream := range []string{dispatcher.StreamPrefill, dispatcher.StreamDecode} {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			st, err := js.Stream(ctx, stream)
			cancel()
			if err != nil {
				ok = false
				break
			}
			c := st.CachedInfo().Cluster
			seen := c != nil && c.Leader == name
			for _, r := range c.Replicas {
				ok = ok && r.Current && !r.Offline
				seen = seen || r.Name == name
			}
			ok = ok && seen && c.Leader != "" && len(c.Replicas) == 2
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s: the stage streams' replicas not all current within 60s", name)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// upgradeLoad sends a request every 50 ms, each through one of the
// gateways up at the time, until stopped. A client whose gateway went
// away under it (its connection refused or broken, a 503, a stream cut
// short) tries again under the same id, through a gateway up then, as
// the kill -9 row's clients do; anything else is a failure.
type upgradeLoad struct {
	t        *testing.T
	mu       sync.Mutex
	gateways []string // base URLs
	next     int
	results  []upgradeResult
	wg       sync.WaitGroup
	stop     chan struct{}
	stopped  chan struct{} // closed when run returns: no request is started after
}

type upgradeResult struct {
	id    string
	tries int
	last  outcome
}

func (u *upgradeLoad) setGateways(urls ...string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.gateways = urls
}

func (u *upgradeLoad) gateway() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.next++
	return u.gateways[u.next%len(u.gateways)]
}

func (u *upgradeLoad) run() {
	defer close(u.stopped)
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-u.stop:
			return
		case <-t.C:
		}
		id := fmt.Sprintf("up-%d", i)
		u.wg.Go(func() {
			r := upgradeResult{id: id}
			for r.tries < 4 {
				r.tries++
				c := &cluster{t: u.t, url: u.gateway()}
				r.last = c.send(id, 30*time.Second, streamed(20)(0))
				if r.last.ok || !(r.last.status == 0 || r.last.status == 503 || r.last.cut) {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			u.mu.Lock()
			u.results = append(u.results, r)
			u.mu.Unlock()
		})
	}
}

// TestClusterRollingUpgrade replaces, one at a time and under load, each
// node of a 3-node NATS cluster (restarted), each of two gateways and the
// prefill and decode workers with the next build (an envelope version
// higher): the next prefill worker reads the old gateways' jobs, the old
// decode worker the next prefill worker's handoffs. Nothing is lost, and
// no client gets an error but those of a gateway's own restart, answered
// once retried under the same id.
func TestClusterRollingUpgrade(t *testing.T) {
	dir := t.TempDir()
	nodes := make([]natsNode, 3)
	for i := range nodes {
		nodes[i] = natsNode{name: fmt.Sprintf("n%d", i+1), client: freeAddr(t), route: freeAddr(t)}
	}
	var servers []*natsServer
	var urls []string
	for _, n := range nodes {
		ndir := filepath.Join(dir, n.name)
		if err := os.MkdirAll(ndir, 0o700); err != nil {
			t.Fatal(err)
		}
		servers = append(servers, startNATSServer(t, n, writeNATSConf(t, ndir, n, nodes, "")))
		urls = append(urls, "nats://"+n.client)
	}
	natsURL := strings.Join(urls, ",")
	nc, js := waitJetStream(t, natsURL)
	env := []string{"PDQ_NATS_URL=" + natsURL, "PDQ_NATS_REPLICAS=3", "PDQ_ACK_WAIT=5s", "PDQ_STALL_TIMEOUT=10s", "PDQ_SHUTDOWN_GRACE=20s"}
	_, pre := startSimProcess(t)
	_, dec := startSimProcess(t, "--itl", "10ms")
	worker := func(start func(*testing.T, []string, ...string) *process, stage dispatcher.Stage, url string) *process {
		w := start(t, append([]string{"PDQ_ENGINE_URL=" + url, "PDQ_ENGINE_SLOTS=8"}, env...), string(stage))
		w.waitLog(t, "stage worker pulling")
		return w
	}
	gateway := func(start func(*testing.T, []string, ...string) *process) (*process, string) {
		g := start(t, append([]string{"PDQ_HTTP_ADDR=127.0.0.1:0"}, env...), "gateway")
		return g, "http://" + g.waitLog(t, "gateway listening")["addr"].(string)
	}
	gA, urlA := gateway(startPDQ)
	gB, urlB := gateway(startPDQ)
	pw := worker(startPDQ, dispatcher.StagePrefill, pre.URL)
	dw := worker(startPDQ, dispatcher.StageDecode, dec.URL)
	waitServing(t, urlA)
	waitServing(t, urlB)
	waitCurrent(t, js, "n1")

	// Which envelope versions the jobs were written in, by stage, and in
	// which phase of the upgrade: heard on the stage subjects.
	var phase atomic.Int32
	var seen sync.Mutex
	versions := map[string]int{} // "<phase> <stage> v<version>" → jobs
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		sub, err := nc.Subscribe(dispatcher.StageSubject(stage)+".>", func(m *nats.Msg) {
			seen.Lock()
			versions[fmt.Sprintf("%d %s v%s", phase.Load(), stage, m.Header.Get(dispatcher.HeaderVersion))]++
			seen.Unlock()
		})
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Unsubscribe()
	}
	u := &upgradeLoad{t: t, stop: make(chan struct{}), stopped: make(chan struct{})}
	u.setGateways(urlA, urlB)
	go u.run()
	stopLoad := sync.OnceFunc(func() {
		close(u.stop)
		<-u.stopped
		u.wg.Wait()
	})
	t.Cleanup(stopLoad) // a step that fails stops the load too
	pause := func() { time.Sleep(2 * time.Second) }
	pause()
	type step struct {
		what string
		do   func()
	}
	var steps []step
	for i, s := range servers {
		steps = append(steps, step{fmt.Sprintf("NATS node %s restarted", nodes[i].name), func() {
			s.stop()
			s.start()
			waitCurrent(t, js, nodes[i].name)
		}})
	}
	// Gateway A first: the old prefill worker reads its jobs; then the
	// prefill worker: it reads gateway B's, and the old decode worker its
	// handoffs.
	steps = append(steps, []step{
		{"gateway A: the next build", func() {
			g, url := gateway(startPDQNext)
			u.setGateways(url, urlB)
			sigterm(t, gA)
			gA, urlA = g, url
		}},
		{"the prefill worker: the next build", func() {
			next := worker(startPDQNext, dispatcher.StagePrefill, pre.URL)
			sigterm(t, pw)
			pw = next
		}},
		{"gateway B: the next build", func() {
			g, url := gateway(startPDQNext)
			u.setGateways(urlA, url)
			sigterm(t, gB)
			gB, urlB = g, url
		}},
		{"the decode worker: the next build", func() {
			next := worker(startPDQNext, dispatcher.StageDecode, dec.URL)
			sigterm(t, dw)
			dw = next
		}},
	}...)
	for i, s := range steps {
		start := time.Now()
		s.do()
		phase.Store(int32(i + 1))
		t.Logf("%s in %v", s.what, time.Since(start).Round(time.Millisecond))
		pause()
	}
	stopLoad()
	// After gateway A's upgrade (step 4) the old prefill worker read its
	// jobs, written a version higher; after the prefill worker's (step 5)
	// the old decode worker read its handoffs.
	seen.Lock()
	t.Logf("jobs by phase, stage and envelope version: %v", versions)
	for _, want := range []string{"4 prefill v4", "5 decode v4"} {
		if versions[want] == 0 {
			t.Errorf("no job %q: the next build wrote no job of a version higher for the old one to read", want)
		}
	}
	seen.Unlock()

	retried, failed := 0, 0
	for _, r := range u.results {
		if r.tries > 1 {
			retried++
		}
		if !r.last.ok {
			failed++
			t.Errorf("%s: no whole answer in %d tries: %+v", r.id, r.tries, r.last)
		}
	}
	t.Logf("rolling upgrade under load: %d requests, %d whole, %d retried under their id after a gateway's restart, %d failed",
		len(u.results), len(u.results)-failed, retried, failed)
	if len(u.results) == 0 {
		t.Fatal("no request was sent")
	}
}
