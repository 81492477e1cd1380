package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// TestAdmissionBound checks the queue bound against a real consumer: past
// max jobs waiting a job is refused, with a wait to suggest; and a look
// past half its life is renewed in the background, so that steady traffic
// never waits for one.
func TestAdmissionBound(t *testing.T) {
	_, js := startJetStream(t)
	ctx := context.Background()
	const pool = "m"
	if _, err := EnsureConsumer(ctx, js, StagePrefill, pool, 0); err != nil {
		t.Fatal(err)
	}
	a := NewAdmission(js, 2)
	if err := a.Check(ctx, StagePrefill, pool, 1); err != nil {
		t.Fatalf("an empty queue refused a job: %v", err)
	}
	for i := range 2 {
		if _, err := js.Publish(ctx, JobSubject(StagePrefill, pool, fmt.Sprint("a-", i)), []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	key := string(StagePrefill) + "/" + pool

	// A look past half its life is served, and renewed behind the request.
	a.mu.Lock()
	a.depth[key] = depthLook{n: 0, at: time.Now().Add(-depthTTL/2 - time.Millisecond)}
	a.mu.Unlock()
	if err := a.Check(ctx, StagePrefill, pool, 1); err != nil {
		t.Fatalf("a look within its life was not served: %v", err)
	}
	waitFor(t, "the look renewed in the background", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.depth[key].n == 2
	})

	// An expired look is not served: the request waits for a new one.
	a.mu.Lock()
	a.depth[key] = depthLook{n: 0, at: time.Now().Add(-depthTTL)}
	a.mu.Unlock()
	err := a.Check(ctx, StagePrefill, pool, 1)
	var full *QueueFullError
	if !errors.As(err, &full) || !errors.Is(err, ErrQueueFull) {
		t.Fatalf("a full queue admitted a job: %v", err)
	}
	if full.Depth != 2 || full.RetryAfter != 3*time.Second {
		t.Errorf("refusal %+v, want depth 2 and a 3s wait", full)
	}
}
