package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
)

// coldClusterRow starts a fresh 3-node NATS cluster and every pdq process
// at the same moment, as a deploy that starts everything together does:
// JetStream has no meta leader for the first seconds, and creating a stream
// waits for one. Every process must wait for the cluster and come up (its
// WARN says what it waits for: not checked, as a quick cluster needs no
// wait); none may exit, or the pool runs a worker short.
func coldClusterRow(t *testing.T) row {
	dir := t.TempDir()
	nodes := make([]natsNode, 3)
	for i := range nodes {
		nodes[i] = natsNode{name: fmt.Sprintf("c%d", i+1), client: freeAddr(t), route: freeAddr(t)}
	}
	_, prefill := startSimProcess(t)
	_, decode := startSimProcess(t, "--itl", "10ms")
	var urls []string
	for _, n := range nodes {
		ndir := filepath.Join(dir, n.name)
		if err := os.MkdirAll(ndir, 0o700); err != nil {
			t.Fatal(err)
		}
		startNATSServer(t, n, writeNATSConf(t, ndir, n, nodes, ""))
		urls = append(urls, "nats://"+n.client)
	}
	env := []string{"PDQ_NATS_URL=" + strings.Join(urls, ","), "PDQ_NATS_REPLICAS=3", "PDQ_ACK_WAIT=5s"}
	start := time.Now()
	gateway := startPDQ(t, append([]string{"PDQ_HTTP_ADDR=127.0.0.1:0"}, env...), "gateway")
	var workers []*process
	for range 2 {
		for _, w := range []struct {
			stage dispatcher.Stage
			url   string
		}{{dispatcher.StagePrefill, prefill.URL}, {dispatcher.StageDecode, decode.URL}} {
			workers = append(workers, startPDQ(t, append([]string{"PDQ_ENGINE_URL=" + w.url, "PDQ_ENGINE_SLOTS=4"}, env...), string(w.stage)))
		}
	}
	url := "http://" + gateway.waitLog(t, "gateway listening")["addr"].(string)
	for _, w := range workers {
		w.waitLog(t, "stage worker pulling")
	}
	up := time.Since(start)
	waitServing(t, url)
	c := &cluster{t: t, url: url}
	r := row{scenario: "a cold 3-node cluster, every process started at once"}
	tally(&r, c.load(10, "cold", 0, pd(8, true)))
	for _, p := range append(workers, gateway) {
		select {
		case <-p.exited:
			t.Errorf("pdq %s exited (%v):\n%s", p.name, p.err, p.output())
		default:
		}
	}
	r.cost = fmt.Sprintf("all %d processes up in %d ms", len(workers)+1, up.Milliseconds())
	return r
}
