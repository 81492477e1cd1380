package stage

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestDecodeBeating: a decode loop tells a gateway that asks
// (dispatcher.DecodeBeating) whether a delivery of a request's generation
// beats to it: from its handler's first use of its replies, for as long
// as it has, until the handler returns. A delivery pulled whose handler
// has not begun to beat (its checks, a wait for an engine slot) does not,
// though the stage loops' own running query counts it. A decode that
// ended its job is still said to have beaten for a while (its gateway may
// have lost its end); one that gave its job back is not (the job waits
// for its next decode).
func TestDecodeBeating(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	started, beating := make(chan *dispatcher.Job, 1), make(chan struct{})
	beat, release := make(chan struct{}), make(chan error)
	lt := startLoop(t, nc, js, Config{Stage: dispatcher.StageDecode, StallTimeout: time.Hour, Handler: func(_ context.Context, d *Delivery) error {
		if d.Job.HandBacks > 0 {
			return nil // the copy a hand-back left: ends without beating
		}
		started <- d.Job
		<-beat
		d.Replies()
		beating <- struct{}{}
		return <-release
	}})
	lt.submit("beat-1")
	var job *dispatcher.Job
	select {
	case job = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not start")
	}
	asks := func(since time.Duration) bool {
		return dispatcher.DecodeBeating(ctx, nc, job.ID, job.Generation, since, time.Second)
	}
	if asks(0) {
		t.Error("a decode said to beat before its handler began to")
	}
	if !lt.loop.runningElsewhere(ctx, job, 2, "another") {
		t.Error("the stage loops' running query does not count the delivery that runs")
	}
	beat <- struct{}{}
	<-beating
	if !asks(0) {
		t.Error("a decode whose handler beats not said to beat")
	}
	if asks(time.Hour) {
		t.Error("a decode that began to beat just now said to have beaten for an hour")
	}
	if dispatcher.DecodeBeating(ctx, nc, job.ID, job.Generation+1, 0, time.Second) {
		t.Error("another generation was taken for the one beating")
	}
	release <- nil
	dispatchertest.WaitFor(t, "the job acked", func() bool { return lt.loop.inFlight.Load() == 0 })
	if !asks(0) {
		t.Error("a decode that ended its job is no longer said to have beaten: a gateway that lost its end would wait for a redelivery that will not come")
	}

	lt.submit("beat-2")
	job = <-started
	beat <- struct{}{}
	<-beating
	release <- verdict.HandBack(errors.New("the engine is full"), openai.NewError(503, "full"))
	dispatchertest.WaitFor(t, "the decode that gave its job back no longer said to beat", func() bool { return !asks(0) })
}
