package pull

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// A stage stream's keeper. nats-server's file store removes a stream's
// last block when an ack empties it, and makes a new block file for the
// next message. At low load, when each job is acked before the next one
// comes, that is a file made and one removed for every job on each stage
// stream, a large share of the queues' CPU at low load (BenchmarkDurablePath;
// the figures are in docs/benchmarks.md). So a
// loop that takes jobs keeps one message in its stream that no consumer
// takes, its keeper, at pdq.<stage>.keep: a token short of any job's
// subject, so no pool's filter matches it. The last block is not empty
// while it holds the keeper; when that block fills and the store begins
// another, the next renewal puts a keeper there. A loop renews it after it
// takes a job, at most every KeepEvery, and purges the older ones; an idle
// loop publishes nothing. The cost: the block held open keeps a write
// cache, which for long bodies takes large buffers from the server's pool
// (docs/benchmarks.md).

// Keeper renews one stage stream's Keeper for a loop.
type Keeper struct {
	js    jetstream.JetStream
	stage dispatcher.Stage
	every time.Duration
	log   *slog.Logger
	took  chan struct{}    // a job was taken since the last renewal
	st    jetstream.Stream // the stage's stream, once looked up
}

func NewKeeper(js jetstream.JetStream, stage dispatcher.Stage, every time.Duration, log *slog.Logger) *Keeper {
	return &Keeper{js: js, stage: stage, every: every, log: log, took: make(chan struct{}, 1)}
}

// TookJob tells the keeper that the loop took a job. It never waits.
func (k *Keeper) TookJob() {
	select {
	case k.took <- struct{}{}:
	default:
	}
}

// Run renews the keeper after a job is taken, at most every k.every,
// until ctx ends.
func (k *Keeper) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-k.took:
		}
		if err := k.renew(ctx); err != nil && ctx.Err() == nil {
			// Only the file store's work is at stake: the next job tries again.
			k.log.Debug("stream keeper not renewed", "stream", dispatcher.StageStream(k.stage), logging.Err(err))
		}
		if sleep.For(ctx, k.every) != nil {
			return
		}
	}
}

// renew publishes a keeper and purges the older ones. Loops renewing in
// the same period publish one keeper between them (one message id), and
// only the one whose keeper was stored purges. A renewal under way as the
// loop stops still purges, within its time-out, rather than leave two.
func (k *Keeper) renew(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	msg := nats.NewMsg(dispatcher.KeeperSubject(k.stage))
	msg.Data = []byte(dispatcher.KeeperNote)
	msg.Header[nats.MsgIdHdr] = []string{"keep/" + strconv.FormatInt(time.Now().UnixNano()/int64(k.every), 10)}
	ack, err := k.js.PublishMsg(ctx, msg)
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if ack.Duplicate {
		return nil
	}
	if k.st == nil {
		if k.st, err = k.js.Stream(ctx, dispatcher.StageStream(k.stage)); err != nil {
			return fmt.Errorf("look up the stream: %w", err)
		}
	}
	if err := k.st.Purge(ctx, jetstream.WithPurgeSubject(dispatcher.KeeperSubject(k.stage)), jetstream.WithPurgeKeep(1)); err != nil {
		return fmt.Errorf("purge older keepers: %w", err)
	}
	return nil
}
