package submit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// TestAdmissionBound checks the queue bound against a real consumer: past
// max jobs waiting a job is refused, with a wait to suggest; and a look
// past depthRenew is renewed in the background, so that steady traffic
// never waits for one.
func TestAdmissionBound(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	const pool = "m"
	cons, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	a := NewAdmission(js, 2)
	// The clock moves only when the test moves it.
	var mu sync.Mutex
	now := time.Now()
	a.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	if err := a.Check(ctx, dispatcher.StagePrefill, pool, oneSlot); err != nil {
		t.Fatalf("an empty queue refused a job: %v", err)
	}
	for i := range 2 {
		if _, err := js.Publish(ctx, dispatcher.JobSubject(dispatcher.StagePrefill, pool, fmt.Sprint("a-", i)), []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	// The consumer counts a stored message a moment after its publish is
	// acknowledged: the looks below must find both.
	dispatchertest.WaitFor(t, "two jobs pending", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 2
	})
	key := string(dispatcher.StagePrefill) + "/" + pool

	// The first look (depth 0) is served while it is young; from
	// depthRenew on it is still served, and renewed behind the request.
	advance(depthRenew - time.Millisecond)
	if err := a.Check(ctx, dispatcher.StagePrefill, pool, oneSlot); err != nil {
		t.Fatalf("a young look was not served: %v", err)
	}
	a.mu.Lock()
	renewing := a.depth[key].renewing
	a.mu.Unlock()
	if renewing {
		t.Fatal("a look younger than depthRenew is being renewed")
	}
	advance(time.Millisecond)
	if err := a.Check(ctx, dispatcher.StagePrefill, pool, oneSlot); err != nil {
		t.Fatalf("a look within its life was not served: %v", err)
	}
	dispatchertest.WaitFor(t, "the look renewed in the background", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.depth[key].n == 2 && !a.depth[key].renewing
	})

	// An expired look is not served: the request waits for a new one.
	a.mu.Lock()
	a.depth[key] = depthLook{n: 0, at: now.Add(-depthTTL)}
	a.mu.Unlock()
	err = a.Check(ctx, dispatcher.StagePrefill, pool, oneSlot)
	var full *QueueFullError
	if !errors.As(err, &full) || !errors.Is(err, dispatcher.ErrQueueFull) {
		t.Fatalf("a full queue admitted a job: %v", err)
	}
	if full.Depth != 2 || full.RetryAfter != 3*time.Second {
		t.Errorf("refusal %+v, want depth 2 and a 3s wait", full)
	}
}

func oneSlot() int { return 1 }
