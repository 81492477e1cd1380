package submit

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// TestLedger checks the record writes kept for NATS: each is made once
// NATS answers, only on the record of the claim it was kept for (a retry
// that claimed the id since is left alone), and none is lost while NATS is
// out of reach.
func TestLedger(t *testing.T) {
	ctx := context.Background()
	nc := embeddedtest.Conn(t, logging.Discard())
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := dispatcher.Ensure(ctx, js); err != nil {
		t.Fatal(err)
	}
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	submitter := NewSubmitter(js, records, registry.NewLiveness(nc))
	claim := func(id string) time.Time {
		now := time.Now()
		rec := &dispatcher.Record{ID: id, State: dispatcher.StateQueued, Generation: 1, Model: "m", Pool: dispatcher.PoolName("m"),
			Gateway: "g", Created: now, Updated: now, Deadline: now.Add(time.Minute)}
		if _, err := submitter.Claim(ctx, rec); err != nil {
			t.Fatal(err)
		}
		return now
	}
	fail := func(r *dispatcher.Record) error {
		r.State = dispatcher.StateFailed
		return nil
	}
	state := func(id string) dispatcher.State {
		rec, _, err := records.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return rec.State
	}

	l := NewLedger(nc, records, 3*time.Second, logging.Discard())
	ours, retried := claim("ours"), claim("retried")
	l.Keep("ours", ours, fail)
	l.Keep("retried", retried.Add(-time.Second), fail) // an earlier claim's write
	l.Keep("never-stored", time.Now(), fail)
	if !l.Has("ours") || l.Len() != 3 {
		t.Fatalf("%d writes kept, want 3", l.Len())
	}
	l.flush(ctx)
	if got := state("ours"); got != dispatcher.StateFailed {
		t.Errorf("the write kept for its claim: record %s, want failed", got)
	}
	if got := state("retried"); got != dispatcher.StateQueued {
		t.Errorf("a write for an earlier claim of the id: record %s, want the retry's queued left alone", got)
	}
	if n := l.Len(); n != 0 {
		t.Errorf("%d writes still kept after a flush with NATS up, want 0", n)
	}

	// Out of reach: a write is kept, not tried, and not lost.
	later := claim("later")
	nc.Close()
	if l.Write(ctx, "later", later, fail, logging.Discard()) {
		t.Error("a write made with NATS closed")
	}
	l.flush(ctx)
	if !l.Has("later") {
		t.Error("a write kept while NATS is out of reach was dropped")
	}
}
