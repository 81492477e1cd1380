package dispatcher

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestTransitionFrom checks the gateway's write of a request's end from
// its claim: straight over the claimed revision when nothing wrote since,
// and from the record as it is when something did (a worker's failure, a
// retry's takeover), which the claim must not overwrite.
func TestTransitionFrom(t *testing.T) {
	ctx := context.Background()
	nc, js := startJetStream(t)
	records, err := OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	sub := NewSubmitter(js, records, NewLiveness(nc))
	done := func(r *Record) error {
		if r.Gateway != "gw-1" {
			return ErrNoChange
		}
		r.State = StateDone
		return nil
	}
	for _, tc := range []struct {
		name      string
		between   func(id string) error // a write after the claim
		wantState State
		wantGW    string
	}{
		{name: "nothing wrote since", wantState: StateDone, wantGW: "gw-1"},
		{name: "a worker wrote since", wantState: StateDone, wantGW: "gw-1", between: func(id string) error {
			_, err := records.Transition(ctx, id, func(r *Record) error { r.Replays = 7; return nil })
			return err
		}},
		{name: "a retry took the id over", wantState: StateQueued, wantGW: "gw-2", between: func(id string) error {
			_, err := records.Transition(ctx, id, func(r *Record) error { r.Gateway = "gw-2"; return nil })
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "tf-" + Token()
			job := &Job{ID: id, Model: "m", Pool: "p", Endpoint: openai.Chat, Body: []byte(`{}`),
				ReplyTo: ReplySubject("gw-1", id), Deadline: time.Now().Add(time.Minute)}
			claim, err := sub.Submit(ctx, StagePrefill, job)
			if err != nil {
				t.Fatal(err)
			}
			if claim.rev == 0 {
				t.Fatal("the claim does not know the revision it wrote: every end would read the record first")
			}
			if tc.between != nil {
				if err := tc.between(id); err != nil {
					t.Fatal(err)
				}
			}
			// A mark on the claim's own copy, never stored: only a write that
			// starts from the claim, without reading the record, stores it.
			claim.rec.Replays = 9
			if _, err := records.TransitionFrom(ctx, claim, done); err != nil {
				t.Fatal(err)
			}
			r, _, err := records.Get(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if r.State != tc.wantState || r.Gateway != tc.wantGW {
				t.Errorf("record %s by %s, want %s by %s", r.State, r.Gateway, tc.wantState, tc.wantGW)
			}
			if tc.between != nil && tc.wantGW == "gw-1" && r.Replays != 7 {
				t.Errorf("the write in between was lost: replays %d, want 7", r.Replays)
			}
			if tc.between == nil && r.Replays != 9 {
				t.Errorf("replays %d, want the claim's 9: the end read the record first instead of writing over the claim's revision", r.Replays)
			}
		})
	}
}

// TestRecordRead checks pdq's own direct read of a record against the
// KeyValue's Get, which it stands in for: the same value and revision for
// a record, and no record for one never written, deleted or purged; and
// the fallback on that Get where no server answers direct gets.
func TestRecordRead(t *testing.T) {
	ctx := context.Background()
	_, js := startJetStream(t)
	records, err := OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	kv := records.kv
	direct := *records
	direct.kv = nil // no fallback: a direct get that went astray fails here
	noDirect := *records
	noDirect.get = "$JS.API.DIRECT.GET.KV_pdq_nobody.$KV.pdq_nobody."
	for _, tc := range []struct {
		name  string
		write func(id string) error
		found bool
	}{
		{"never written", func(string) error { return nil }, false},
		{"written", func(id string) error { _, err := kv.Put(ctx, id, []byte(`{"id":"x"}`)); return err }, true},
		{"written twice", func(id string) error {
			if _, err := kv.Put(ctx, id, []byte(`{"id":"x"}`)); err != nil {
				return err
			}
			_, err := kv.Put(ctx, id, []byte(`{"id":"x","generation":2}`))
			return err
		}, true},
		{"deleted", func(id string) error {
			if _, err := kv.Put(ctx, id, []byte(`{}`)); err != nil {
				return err
			}
			return kv.Delete(ctx, id)
		}, false},
		{"purged", func(id string) error {
			if _, err := kv.Put(ctx, id, []byte(`{}`)); err != nil {
				return err
			}
			return kv.Purge(ctx, id)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "read-" + PoolName(tc.name)
			if err := tc.write(id); err != nil {
				t.Fatal(err)
			}
			e, kerr := kv.Get(ctx, id)
			if found := kerr == nil; found != tc.found {
				t.Fatalf("the KeyValue's Get: %v", kerr)
			}
			for name, rs := range map[string]*Records{"direct": &direct, "fallback": &noDirect} {
				data, rev, err := rs.read(ctx, id)
				switch {
				case !tc.found && !errors.Is(err, ErrNoRecord):
					t.Errorf("%s: %s, %d, %v; want ErrNoRecord", name, data, rev, err)
				case tc.found && (err != nil || string(data) != string(e.Value()) || rev != e.Revision()):
					t.Errorf("%s: %s, %d, %v; want %s, %d", name, data, rev, err, e.Value(), e.Revision())
				}
			}
			if !tc.found {
				return
			}
			// At its revision a record is left undecoded; at any other, read.
			if r, _, err := records.GetChanged(ctx, id, e.Revision()); r != nil || err != nil {
				t.Errorf("at its revision: %+v, %v; want no record, undecoded", r, err)
			}
			if r, _, err := records.GetChanged(ctx, id, e.Revision()-1); r == nil || err != nil {
				t.Errorf("past its revision: %+v, %v; want the record", r, err)
			}
		})
	}
}

// TestRecoveredRevision: a claim found stored after its create's answer
// was lost passes its revision on to the job only while the record is the
// claim as written; a record ended or moved on since passes none, so that
// admit reads it.
func TestRecoveredRevision(t *testing.T) {
	claim := &Record{ID: "r-1", State: StateQueued, Generation: 2, Gateway: "gw-1"}
	for _, tc := range []struct {
		name   string
		stored Record
		want   uint64
	}{
		{"as written", *claim, 7},
		{"ended since", Record{ID: "r-1", State: StateCancelled, Generation: 2, Gateway: "gw-1"}, 0},
		{"a later generation", Record{ID: "r-1", State: StateQueued, Generation: 3, Gateway: "gw-1"}, 0},
	} {
		if got := recoveredRevision(&tc.stored, 7, claim); got != tc.want {
			t.Errorf("%s: revision %d, want %d", tc.name, got, tc.want)
		}
	}
}
