package dispatcher

import (
	"context"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
)

// TestDecodeGateCountsWhatItLetThrough: within one look at the decode
// backlog, the prefills the gate let through count as waiting handoffs,
// so a burst cannot pass a gate that a fresh look would close; the next
// look starts from what is there.
func TestDecodeGateCountsWhatItLetThrough(t *testing.T) {
	_, js := startJetStream(t)
	ctx := context.Background()
	pool := PoolName(t.Name())
	if _, err := EnsureConsumer(ctx, js, StageDecode, pool, time.Second); err != nil {
		t.Fatal(err)
	}
	g, err := newDecodeGate(ctx, js, pool, 10*time.Second, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	// No decode worker is registered: the gate counts one slot, so one
	// handoff may wait for it.
	g.fresh = time.Hour // every call below within one look
	if !g.isOpen(ctx) {
		t.Fatal("an empty decode backlog: the gate is closed")
	}
	if g.isOpen(ctx) {
		t.Fatal("a second prefill within one look, for one decode slot: the gate is open")
	}
	g.fresh = 0 // the next call looks again: nothing was handed off
	if !g.isOpen(ctx) {
		t.Fatal("a fresh look at an empty backlog: the gate is closed")
	}
	if g.pending != 0 || g.since != 1 {
		t.Errorf("after a fresh look: %d waiting, %d let through; want 0 and 1", g.pending, g.since)
	}
}
