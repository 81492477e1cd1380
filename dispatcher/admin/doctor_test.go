package admin

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// A latched store needs a full disk (the fault suite's "a full JetStream
// disk" makes one); these tests check, on a healthy server, what the
// doctor does with what it finds.

// TestProbeStore: a stream that stores answers the probe, which leaves
// nothing behind.
func TestProbeStore(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	for _, target := range storeTargets() {
		stores, err := ProbeStore(ctx, js, target.stream, target.probe)
		if !stores || err != nil {
			t.Errorf("%s: stores %v, %v; want true", target.stream, stores, err)
		}
		st, err := js.Stream(ctx, target.stream)
		if err != nil {
			t.Fatal(err)
		}
		want := uint64(0)
		if strings.HasPrefix(target.stream, "KV_") {
			want = 1 // a delete marker: no key to the bucket's readers
		}
		if strings.HasPrefix(target.probe, "pdq.") && strings.Count(target.probe, ".") != 2 {
			t.Errorf("%s: probe subject %s, want a token short of a job's", target.stream, target.probe)
		}
		if n := st.CachedInfo().State.Msgs; n != want {
			t.Errorf("%s holds %d messages after a probe: want %d", target.stream, n, want)
		}
	}
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	if err := records.List(ctx, func(r *dispatcher.Record) bool { t.Errorf("a record listed after the probes: %+v", r); return true }); err != nil {
		t.Errorf("records listed after the probes: %v", err)
	}
	if h := CheckStores(ctx, js); len(h) != len(storeTargets()) || !h[0].Stores {
		t.Errorf("CheckStores = %+v, want every stream storing", h)
	}
}

// TestRebuildKeepsWhatMatters rebuilds the request records' bucket and the
// prefill stream: the records come back as they were, and take writes (a
// record stored again once kept the revision it was read at, in a header,
// and every write of it was refused); of the jobs, only those whose
// request is live at their generation come back, their message ids kept.
func TestRebuildKeepsWhatMatters(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	pool := dispatcher.PoolName(t.Name())
	job := func(id string, generation int) {
		j := &dispatcher.Job{ID: id, Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`), Generation: generation}
		if _, err := js.PublishMsg(ctx, j.Msg(dispatcher.StagePrefill)); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range []struct {
		id    string
		gen   int
		state dispatcher.State
	}{{"live", 1, dispatcher.StateQueued}, {"ended", 1, dispatcher.StateFailed}, {"moved-on", 2, dispatcher.StateQueued}} {
		if _, err := records.Create(ctx, &dispatcher.Record{ID: r.id, State: dispatcher.StateQueued, Generation: 1, Created: time.Now()}); err != nil {
			t.Fatal(err)
		}
		if _, err := records.Transition(ctx, r.id, func(rec *dispatcher.Record) error { rec.State, rec.Generation = r.state, r.gen; return nil }); err != nil {
			t.Fatal(err)
		}
		job(r.id, 1)
	}
	if _, err := js.Publish(ctx, dispatcher.KeeperSubject(dispatcher.StagePrefill), []byte(dispatcher.KeeperNote)); err != nil {
		t.Fatal(err)
	}
	d := NewStoreDoctor(js, records, nil, logging.Discard())
	for _, target := range storeTargets() {
		if target.stream != "KV_"+dispatcher.BucketRequests && target.stream != dispatcher.StreamPrefill {
			continue
		}
		// A stream that stores is not rebuilt...
		if err := d.rebuild(ctx, target); err == nil {
			t.Fatalf("rebuilt %s, which stores", target.stream)
		}
		// ...but here it is, as if it had stopped storing.
		st, err := js.Stream(ctx, target.stream)
		if err != nil {
			t.Fatal(err)
		}
		info := st.CachedInfo()
		kept, read, err := d.collect(ctx, st, info, target)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.remake(ctx, target, info, kept, read, time.Now()); err != nil {
			t.Fatalf("remake %s: %v", target.stream, err)
		}
	}

	for _, id := range []string{"live", "ended", "moved-on"} {
		r, _, err := records.Get(ctx, id)
		if err != nil {
			t.Fatalf("record %s after the rebuild: %v", id, err)
		}
		if _, err := records.Transition(ctx, id, func(rec *dispatcher.Record) error { rec.Replays++; return nil }); err != nil {
			t.Errorf("record %s (%s) takes no write after the rebuild: %v", id, r.State, err)
		}
	}
	st, err := js.Stream(ctx, dispatcher.StreamPrefill)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(">"))
	if err != nil {
		t.Fatal(err)
	}
	if len(info.State.Subjects) != 1 || info.State.Subjects[dispatcher.JobSubject(dispatcher.StagePrefill, pool, "live")] != 1 {
		t.Fatalf("after the rebuild the prefill stream holds %v: want the live request's job alone", info.State.Subjects)
	}
	m, err := st.GetLastMsgForSubject(ctx, dispatcher.JobSubject(dispatcher.StagePrefill, pool, "live"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := m.Header.Get(jetstream.MsgIDHeader), "live/p1"; got != want {
		t.Errorf("the job kept message id %q, want %q", got, want)
	}
	if m.Header.Get(dispatcher.HeaderRebuilt) == "" {
		t.Errorf("the job stored again is not marked so: %v", m.Header)
	}
	if m.Sequence <= 3 {
		t.Errorf("the job stored again has sequence %d: want the old stream's sequences gone on (over 3)", m.Sequence)
	}
	// A consumer works on the stream made anew.
	cons, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second)); err != nil || got.Headers().Get(jetstream.MsgIDHeader) != "live/p1" {
		t.Errorf("pull after the rebuild: %v %v", got, err)
	}
	if _, _, err := records.Get(ctx, "gone"); !errors.Is(err, dispatcher.ErrNoRecord) {
		t.Errorf("a record never written: %v", err)
	}
}

// TestAckFloorOf: a job's ack floor is its consumer's: the pool's shared
// one, its preferred engine's, or an old consumer's not yet narrowed.
func TestAckFloorOf(t *testing.T) {
	floors := map[string]uint64{"pdq.prefill.m.*": 7, "pdq.prefill.m.*.e0123456789": 9, "pdq.decode.m.>": 3}
	for _, tc := range []struct {
		subject string
		floor   uint64
		ok      bool
	}{
		{"pdq.prefill.m.req-1", 7, true},
		{"pdq.prefill.m.req-1.e0123456789", 9, true},
		{"pdq.prefill.m.req-1.e9999999999", 0, false},
		{"pdq.decode.m.req-1", 3, true},
		{"pdq.prefill.other.req-1", 0, false},
		{"pdq.prefill", 0, false},
	} {
		if floor, ok := ackFloorOf(floors, tc.subject); floor != tc.floor || ok != tc.ok {
			t.Errorf("%s: %d, %v; want %d, %v", tc.subject, floor, ok, tc.floor, tc.ok)
		}
	}
}
