package pull

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestStuckConsumer: an engine's consumer is taken from only when it has
// jobs its engine does not take: pending or ack-pending (a redelivery
// waits among those), no pull waiting, and nothing delivered for
// takeOverAfter by the server's clock.
func TestStuckConsumer(t *testing.T) {
	now := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	long, short := now.Add(-2*takeOverAfter), now.Add(-takeOverAfter/2)
	for _, tc := range []struct {
		name                   string
		pending, ackPending    int
		waiting                int
		created, lastDelivered time.Time
		want                   bool
	}{
		{"empty", 0, 0, 0, long, time.Time{}, false},
		{"pending, never delivered, old", 2, 0, 0, long, time.Time{}, true},
		{"pending, new consumer", 2, 0, 0, short, time.Time{}, false},
		{"pending, delivered a moment ago", 2, 0, 0, long, short, false},
		{"pending, delivered long ago", 2, 0, 0, long, long, true},
		{"a pull waits", 2, 0, 1, long, long, false},
		{"only a redelivery waits", 0, 1, 0, long, long, true},
	} {
		info := &jetstream.ConsumerInfo{NumPending: uint64(tc.pending), NumAckPending: tc.ackPending, NumWaiting: tc.waiting,
			Created: tc.created, TimeStamp: now}
		if !tc.lastDelivered.IsZero() {
			last := tc.lastDelivered
			info.Delivered.Last = &last
		}
		if got := stuckConsumer(info); got != tc.want {
			t.Errorf("%s: stuck %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestTakeOverPace: looks that find all idle come further apart, doubling
// up to takeOverIdleEvery; one that finds work waiting brings them back
// to TakeOverEvery.
func TestTakeOverPace(t *testing.T) {
	to := NewTakeOver(nil, "prefill", "p", "e", time.Second, nil)
	want := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, takeOverIdleEvery, takeOverIdleEvery}
	for i, w := range want {
		to.paced(false)
		if got := to.Every(); got != w {
			t.Errorf("after %d idle looks: next in %v, want %v", i+1, got, w)
		}
	}
	to.paced(true)
	if got := to.Every(); got != TakeOverEvery {
		t.Errorf("after a busy look: next in %v, want %v", got, TakeOverEvery)
	}
}
