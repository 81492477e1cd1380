package dispatcher

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestReusedID: a reused id is one request whatever its path.
func TestReusedID(t *testing.T) {
	nc, js := startJetStream(t)
	ctx := context.Background()
	records, _ := OpenRecords(ctx, js)
	sub := NewSubmitter(js, records, NewLiveness(nc))
	mk := func() *Job {
		return &Job{ID: "same-1", Model: "m", Pool: "p", Endpoint: openai.Chat, Body: []byte(`{}`),
			ReplyTo: ReplySubject("gw-nobody-listens", "same-1"), Deadline: time.Now().Add(time.Minute)}
	}
	pings, err := AnswerPings(nc, "gw-alive")
	if err != nil {
		t.Fatal(err)
	}
	defer pings.Unsubscribe()
	live := mk()
	live.ReplyTo = ReplySubject("gw-alive", "same-1")
	if _, err := sub.Submit(ctx, StagePrefill, live); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Submit(ctx, StageDecode, mk()); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("a decode-only request with a live P/D request's id: %v, want ErrDuplicate", err)
	}
	pings.Unsubscribe()      // the first request's gateway dies
	other := NewLiveness(nc) // another gateway, connected for a while
	other.stable = time.Now().Add(-time.Minute)
	other.silent["gw-alive"] = silence{first: time.Now().Add(-goneAfter), last: time.Now()}
	sub = NewSubmitter(js, records, other)
	retry := mk()
	if _, err := sub.Submit(ctx, StageDecode, retry); err != nil {
		t.Fatalf("a retry after the gateway died: %v", err)
	}
	if retry.Generation != 2 {
		t.Errorf("the retry runs as generation %d, want 2", retry.Generation)
	}
	if err := records.End(ctx, "same-1", 2, StateDone, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Submit(ctx, StagePrefill, mk()); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("an id that delivered: %v, want ErrDuplicate", err)
	}
}
