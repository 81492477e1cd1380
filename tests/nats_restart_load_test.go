package tests

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
)

// natsRestartUnderLoad kills a standalone nats-server (-9) while a wave of
// P/D streams runs, more than the workers' slots, and starts it again down
// later on its store, with the ack wait and the stall time-out at 5 s, as
// operators run them. Jobs in flight then come back, some as first
// deliveries (the server forgot the earlier one, or a worker's ack sat in
// its reconnect buffer), and prefills run again. What a restart must not
// do: decode one handoff twice (a prefill engine serves its blocks to one
// read: a second read fails, or reads blocks since reused), or leave KV
// held. Every accepted request ends in one answer.
func natsRestartUnderLoad(t *testing.T, down time.Duration) row {
	dir := t.TempDir()
	node := natsNode{name: "standalone", client: freeAddr(t)}
	ns := startNATSServer(t, node, writeNATSConf(t, dir, node, nil, ""))
	c := startClusterOn(t, ns.url, clusterOptions{decodeSim: []string{"--itl", "25ms"},
		prefillSim: []string{"--prefill-overhead", "150ms"},
		env:        []string{"PDQ_ACK_WAIT=5s", fmt.Sprintf("PDQ_STALL_TIMEOUT=%v", natsStallTimeout)}})
	for range 2 {
		c.worker(dispatcher.StagePrefill, 2)
		c.worker(dispatcher.StageDecode, 4)
	}
	c.ready()
	p0, d0 := c.prefill.Stats(t), c.decode.Stats(t)

	const n = 60
	var outs []timed
	done := make(chan struct{})
	go func() { outs = c.wave(n, 50*time.Millisecond, "nl", streamed(40), -1, nil); close(done) }()
	time.Sleep(1500 * time.Millisecond)
	ns.kill9()
	time.Sleep(down)
	ns.start()
	waitReady(t, c.url, http.StatusOK, 20*time.Second)
	<-done
	r := row{scenario: fmt.Sprintf("NATS down %v under load (ack wait 5 s)", down)}
	tally(&r, outcomes(outs))
	r.blocksHeld = c.settle(20 * time.Second)
	p1, d1 := c.prefill.Stats(t), c.decode.Stats(t)
	twice := (d1.KVReadFailures - d0.KVReadFailures) + (p1.UnknownNotifs - p0.UnknownNotifs)
	r.cost = fmt.Sprintf("%d prefills, %d KV reads, %d second reads", p1.Prefills-p0.Prefills, d1.KVReads-d0.KVReads, twice)
	if twice != 0 {
		t.Errorf("%d reads of KV already read or released (decode engine %+v, prefill engine %+v): want none", twice, d1, p1)
	}
	return r
}
