package stage

import (
	"context"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// TestDecodeBeating: a decode loop tells a gateway that asks
// (dispatcher.DecodeBeating) whether a delivery of a request's generation
// beats to it: from its handler's first use of its replies, for as long
// as it has, until the handler returns. A delivery pulled whose handler
// has not begun to beat (its checks, a wait for an engine slot) does not,
// though the stage loops' own running query counts it.
func TestDecodeBeating(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	started, beating := make(chan *dispatcher.Job, 1), make(chan struct{})
	beat, release := make(chan struct{}), make(chan struct{})
	lt := startLoop(t, nc, js, Config{Stage: dispatcher.StageDecode, Handler: func(_ context.Context, d *Delivery) error {
		started <- d.Job
		<-beat
		d.Replies()
		close(beating)
		<-release
		return nil
	}})
	lt.submit("beat-1")
	var job *dispatcher.Job
	select {
	case job = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not start")
	}
	asks := func(since time.Duration) bool {
		return dispatcher.DecodeBeating(ctx, nc, job.ID, job.Generation, since, 200*time.Millisecond)
	}
	if asks(0) {
		t.Error("a decode said to beat before its handler began to")
	}
	if !lt.loop.runningElsewhere(ctx, job, 2, "another") {
		t.Error("the stage loops' running query does not count the delivery that runs")
	}
	close(beat)
	<-beating
	if !asks(0) {
		t.Error("a decode whose handler beats not said to beat")
	}
	if asks(time.Hour) {
		t.Error("a decode that began to beat just now said to have beaten for an hour")
	}
	if dispatcher.DecodeBeating(ctx, nc, job.ID, job.Generation+1, 0, 200*time.Millisecond) {
		t.Error("another generation was taken for the one beating")
	}
	close(release)
	dispatchertest.WaitFor(t, "the finished decode no longer said to beat", func() bool { return !asks(0) })
}
