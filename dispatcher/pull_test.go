package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestShutdownDropsNoPulledJob: a job the server hands a loop's waiting
// pull as the loop stops is run or handed back at once, never dropped to
// wait out the ack wait. A dropped handoff comes back as a redelivery,
// which a decode stage must take for one whose KV may have been read: a
// new prefill, and the first one's KV held for its lease.
func TestShutdownDropsNoPulledJob(t *testing.T) {
	nc, js := startJetStream(t)
	ctx := context.Background()
	for i := range 40 {
		var ran atomic.Int32
		pool := fmt.Sprintf("sd-%d", i)
		lt := startLoopOn(t, nc, js, pool, StageConfig{AckWait: time.Minute, Handler: func(context.Context, *Delivery) error {
			ran.Add(1)
			return nil
		}})
		cons, err := js.Consumer(ctx, stageStream(StagePrefill), ConsumerName(StagePrefill, pool))
		waitFor(t, "the loop's pull", func() bool {
			if err != nil {
				cons, err = js.Consumer(ctx, stageStream(StagePrefill), ConsumerName(StagePrefill, pool))
				return false
			}
			info, err := cons.Info(ctx)
			return err == nil && info.NumWaiting > 0
		})
		// The job and the stop cross: the stop comes a little later each
		// turn, from before the job's delivery to after it.
		lt.submit(fmt.Sprintf("sd-%d", i))
		time.Sleep(time.Duration(i) * 25 * time.Microsecond)
		lt.stop()
		// A job run was acked without waiting for the server's word: give
		// the ack a moment. A job dropped stays unacked for the ack wait.
		var info *jetstream.ConsumerInfo
		settled := func() bool {
			info, err = cons.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return info.NumAckPending == 0 && uint64(ran.Load())+info.NumPending == 1
		}
		for deadline := time.Now().Add(2 * time.Second); !settled() && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		if !settled() {
			t.Fatalf("turn %d: %d jobs delivered and unacked, %d waiting, %d redelivered, %d run; want the job run or waiting, not held",
				i, info.NumAckPending, info.NumPending, info.NumRedelivered, ran.Load())
		}
	}
}

func TestPullEnded(t *testing.T) {
	for _, tc := range []struct {
		status, description string
		want                error // nil: an error of its own, naming the status
	}{
		{"404", "No Messages", nats.ErrTimeout},
		{"408", "Request Timeout", nats.ErrTimeout},
		{"409", "Leadership Change", nats.ErrTimeout},
		{"409", "Consumer Deleted", jetstream.ErrConsumerDeleted},
		{"503", "", nats.ErrNoResponders},
		{"409", "Exceeded MaxWaiting", nil},
	} {
		err := pullEnded(tc.status, tc.description)
		switch {
		case tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("%s %s: %v, want %v", tc.status, tc.description, err, tc.want)
		case tc.want == nil && (errors.Is(err, nats.ErrTimeout) || !strings.Contains(err.Error(), tc.description)):
			t.Errorf("%s %s: %v, want an error that names it", tc.status, tc.description, err)
		}
	}
}
