package submit

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestReusedID: a reused id is one request whatever its path.
func TestReusedID(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	records, _ := dispatcher.OpenRecords(ctx, js)
	sub := NewSubmitter(js, records, registry.NewLiveness(nc))
	mk := func() *dispatcher.Job {
		return &dispatcher.Job{ID: "same-1", Model: "m", Pool: "p", Endpoint: openai.Chat, Body: []byte(`{}`),
			ReplyTo: dispatcher.ReplySubject("gw-nobody-listens", "same-1"), Deadline: time.Now().Add(time.Minute)}
	}
	pings, err := registry.AnswerPings(nc, "gw-alive")
	if err != nil {
		t.Fatal(err)
	}
	defer pings.Unsubscribe()
	live := mk()
	live.ReplyTo = dispatcher.ReplySubject("gw-alive", "same-1")
	if _, err := sub.Submit(ctx, dispatcher.StagePrefill, live); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Submit(ctx, dispatcher.StageDecode, mk()); !errors.Is(err, dispatcher.ErrDuplicate) {
		t.Fatalf("a decode-only request with a live P/D request's id: %v, want ErrDuplicate", err)
	}
	pings.Unsubscribe() // the first request's gateway dies
	// Another gateway, which has found the first one silent for long
	// enough (TestLiveness holds what counts as gone).
	sub = NewSubmitter(js, records, goneGateway("gw-alive"))
	retry := mk()
	if _, err := sub.Submit(ctx, dispatcher.StageDecode, retry); err != nil {
		t.Fatalf("a retry after the gateway died: %v", err)
	}
	if retry.Generation != 2 {
		t.Errorf("the retry runs as generation %d, want 2", retry.Generation)
	}
	if err := records.End(ctx, "same-1", 2, dispatcher.StateDone, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Submit(ctx, dispatcher.StagePrefill, mk()); !errors.Is(err, dispatcher.ErrDuplicate) {
		t.Fatalf("an id that delivered: %v, want ErrDuplicate", err)
	}
}

// TestTransitionFrom checks the gateway's write of a request's end from
// its claim: straight over the claimed revision when nothing wrote since,
// and from the record as it is when something did (a worker's failure, a
// retry's takeover), which the claim must not overwrite.
func TestTransitionFrom(t *testing.T) {
	ctx := context.Background()
	nc, js := dispatchertest.JetStream(t)
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	sub := NewSubmitter(js, records, registry.NewLiveness(nc))
	done := func(r *dispatcher.Record) error {
		if r.Gateway != "gw-1" {
			return dispatcher.ErrNoChange
		}
		r.State = dispatcher.StateDone
		return nil
	}
	for _, tc := range []struct {
		name      string
		between   func(id string) error // a write after the claim
		wantState dispatcher.State
		wantGW    string
	}{
		{name: "nothing wrote since", wantState: dispatcher.StateDone, wantGW: "gw-1"},
		{name: "a worker wrote since", wantState: dispatcher.StateDone, wantGW: "gw-1", between: func(id string) error {
			_, err := records.Transition(ctx, id, func(r *dispatcher.Record) error { r.Replays = 7; return nil })
			return err
		}},
		{name: "a retry took the id over", wantState: dispatcher.StateQueued, wantGW: "gw-2", between: func(id string) error {
			_, err := records.Transition(ctx, id, func(r *dispatcher.Record) error { r.Gateway = "gw-2"; return nil })
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "tf-" + dispatcher.Token()
			job := &dispatcher.Job{ID: id, Model: "m", Pool: "p", Endpoint: openai.Chat, Body: []byte(`{}`),
				ReplyTo: dispatcher.ReplySubject("gw-1", id), Deadline: time.Now().Add(time.Minute)}
			claim, err := sub.Submit(ctx, dispatcher.StagePrefill, job)
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
			if _, err := claim.Transition(ctx, records, done); err != nil {
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

// TestRecoveredRevision: a claim found stored after its create's answer
// was lost passes its revision on to the job only while the record is the
// claim as written; a record ended or moved on since passes none, so that
// admit reads it.
func TestRecoveredRevision(t *testing.T) {
	claim := &dispatcher.Record{ID: "r-1", State: dispatcher.StateQueued, Generation: 2, Gateway: "gw-1"}
	for _, tc := range []struct {
		name   string
		stored dispatcher.Record
		want   uint64
	}{
		{"as written", *claim, 7},
		{"ended since", dispatcher.Record{ID: "r-1", State: dispatcher.StateCancelled, Generation: 2, Gateway: "gw-1"}, 0},
		{"a later generation", dispatcher.Record{ID: "r-1", State: dispatcher.StateQueued, Generation: 3, Gateway: "gw-1"}, 0},
	} {
		if got := recoveredRevision(&tc.stored, 7, claim); got != tc.want {
			t.Errorf("%s: revision %d, want %d", tc.name, got, tc.want)
		}
	}
}

// goneGateway is the liveness of a gateway that has found one other
// gateway gone, and every other alive.
type goneGateway string

func (g goneGateway) Alive(_ context.Context, id string) bool { return id != string(g) }

// TestUnrun: a request that ended before its job was published leaves a
// record of how it ended; an id another live request holds is left alone.
func TestUnrun(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	records, _ := dispatcher.OpenRecords(ctx, js)
	sub := NewSubmitter(js, records, registry.NewLiveness(nc))
	pings, err := registry.AnswerPings(nc, "gw-alive")
	if err != nil {
		t.Fatal(err)
	}
	defer pings.Unsubscribe()
	mk := func(id string) *dispatcher.Job {
		return &dispatcher.Job{ID: id, Model: "m", Pool: "p", Endpoint: openai.Chat,
			ReplyTo: dispatcher.ReplySubject("gw-alive", id), Deadline: time.Now().Add(time.Minute)}
	}
	if err := sub.Unrun(ctx, mk("left"), dispatcher.StateCancelled, &dispatcher.RecordError{Status: 499, Message: "client went away"}); err != nil {
		t.Fatal(err)
	}
	rec, _, err := records.Get(ctx, "left")
	if err != nil || rec.State != dispatcher.StateCancelled || rec.Error == nil || rec.Error.Status != 499 {
		t.Fatalf("record %+v, %v; want cancelled with status 499", rec, err)
	}
	live := mk("held")
	live.Body = []byte(`{}`)
	if _, err := sub.Submit(ctx, dispatcher.StagePrefill, live); err != nil {
		t.Fatal(err)
	}
	if err := sub.Unrun(ctx, mk("held"), dispatcher.StateExpired, nil); !errors.Is(err, dispatcher.ErrDuplicate) {
		t.Fatalf("an id a live request holds: %v, want ErrDuplicate", err)
	}
	if rec, _, err := records.Get(ctx, "held"); err != nil || rec.State != dispatcher.StateQueued {
		t.Errorf("the live request's record %+v, %v; want it left queued", rec, err)
	}
}

// TestClaimFindsItsOwn: a claim whose create went unanswered, tried
// again, finds the record its first create stored late (a NATS node cut
// off from its cluster holds the request on its route and delivers it
// once healed): that is this claim, not another request's. Before, the
// retry's create found the key taken and the client was answered 409 for
// its own request (TestClusterNATSPartitions, the minority side).
func TestClaimFindsItsOwn(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	records, _ := dispatcher.OpenRecords(ctx, js)
	pings, err := registry.AnswerPings(nc, "gw-alive")
	if err != nil {
		t.Fatal(err)
	}
	defer pings.Unsubscribe()
	sub := NewSubmitter(js, records, registry.NewLiveness(nc))
	job := &dispatcher.Job{ID: "own-1", Model: "m", Pool: "p", Endpoint: openai.Chat, Body: []byte(`{}`),
		ReplyTo: dispatcher.ReplySubject("gw-alive", "own-1"), Deadline: time.Now().Add(time.Minute), Submitted: time.Now()}
	rec := recordOf(job, dispatcher.StagePrefill)
	if _, err := records.Create(ctx, rec); err != nil { // the first create, stored after its answer was lost
		t.Fatal(err)
	}
	claim, err := sub.Claim(ctx, recordOf(job, dispatcher.StagePrefill))
	if err != nil {
		t.Fatalf("the claim that stored the record, tried again: %v", err)
	}
	if claim.rec.Generation != 1 {
		t.Errorf("the claim runs generation %d, want 1", claim.rec.Generation)
	}
	// Another request with the id, from the same gateway a moment later,
	// is still refused.
	other := *job
	other.Submitted = job.Submitted.Add(time.Millisecond)
	if _, err := sub.Claim(ctx, recordOf(&other, dispatcher.StagePrefill)); !errors.Is(err, dispatcher.ErrDuplicate) {
		t.Errorf("another request with a live request's id: %v, want ErrDuplicate", err)
	}
}
