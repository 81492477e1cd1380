package tests

import (
	"fmt"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
)

// burstRow sends a burst of P/D streams, 20 times what the engines run at
// once, to workers left at their default slots (far more than these
// engines take), with the KV TTL and the prefill engine's lease a few
// decodes long. A prefill must start only while its handoff can be
// decoded within the TTL: prefilling further ahead makes KV that ages
// past the TTL (prefilled again) or expires unread on the engine (held
// until the lease, and a read of it fails).
func burstRow(t *testing.T) row {
	const prefillSeqs, decodeSeqs = 4, 2
	c := startCluster(t, clusterOptions{
		prefillSim: []string{"--max-num-seqs", fmt.Sprint(prefillSeqs), "--kv-lease", "6s"},
		decodeSim:  []string{"--max-num-seqs", fmt.Sprint(decodeSeqs), "--itl", "10ms"},
		env:        []string{"PDQ_KV_TTL=5s", "PDQ_ACK_WAIT=5s"},
	})
	c.worker(dispatcher.StagePrefill, 0) // 0: the default slots
	c.worker(dispatcher.StageDecode, 0)
	c.ready()
	p0, d0 := c.prefill.Stats(t), c.decode.Stats(t)

	n := 20 * (prefillSeqs + decodeSeqs)
	outs := c.timedLoad(n, "burst", streamed(20))
	r := row{scenario: fmt.Sprintf("a burst of %d streams, 20× the engines' seats", n)}
	tally(&r, outcomes(outs))
	r.blocksHeld = c.settle(20 * time.Second)
	p1, d1 := c.prefill.Stats(t), c.decode.Stats(t)
	prefills, expired, failed := p1.Prefills-p0.Prefills, p1.HoldsExpired-p0.HoldsExpired, d1.KVReadFailures-d0.KVReadFailures
	r.cost = fmt.Sprintf("%d prefills, %d holds expired, %d KV reads failed, slowest %v",
		prefills, expired, failed, longest(outs).Round(100*time.Millisecond))
	if expired != 0 || failed != 0 {
		t.Errorf("%d holds expired unread and %d KV reads failed: want none (prefill engine %+v, decode engine %+v)", expired, failed, p1, d1)
	}
	if r.completed != n {
		t.Errorf("%d of %d requests completed: want all", r.completed, n)
	}
	// One prefill a request; a handful more would be a gate a moment late
	// on a busy machine, not one that lets the burst through.
	if wasted := prefills - int64(n); wasted > int64(n/20) {
		t.Errorf("%d prefills for %d requests: want one each (at most %d more)", prefills, n, n/20)
	}
	return r
}
