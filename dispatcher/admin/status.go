package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
)

// QueueStatus is one stage queue of a pool, as its consumer sees it.
type QueueStatus struct {
	Pool  string           `json:"pool"`
	Stage dispatcher.Stage `json:"stage"`
	// Waiting jobs have not been delivered yet; Running ones are delivered
	// and not yet acked (a crashed worker's count until the ack wait ends).
	Waiting uint64 `json:"waiting"`
	Running int    `json:"running"`
	// IdlePulls are the workers' pulls waiting for a job: about one per
	// worker with a free slot.
	IdlePulls int `json:"idle_pulls"`
	// Redelivered counts the jobs delivered more than once that are not
	// yet acked.
	Redelivered int `json:"redelivered"`
	// OldestSeconds is how long the oldest waiting job has waited; 0 when
	// none waits.
	OldestSeconds float64 `json:"oldest_s"`
}

// Queues reports pool's prefill and decode queues; a stage whose consumer
// does not exist yet (no worker has pulled) is left out.
func Queues(ctx context.Context, js jetstream.JetStream, pool string) ([]QueueStatus, error) {
	var out []QueueStatus
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		cons, err := js.Consumer(ctx, dispatcher.StageStream(stage), dispatcher.ConsumerName(stage, pool))
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s queue of pool %s: %w", stage, pool, err)
		}
		info := cons.CachedInfo()
		q := QueueStatus{Pool: pool, Stage: stage, Waiting: info.NumPending, Running: info.NumAckPending,
			IdlePulls: info.NumWaiting, Redelivered: info.NumRedelivered}
		if info.NumPending > 0 {
			q.OldestSeconds = oldestWaiting(ctx, js, stage, pool, info.Delivered.Stream+1)
		}
		// With affinity, jobs wait in the engines' consumers too: counted,
		// though the oldest is the shared queue's.
		engines, err := dispatcher.EngineConsumers(ctx, js, stage, pool)
		if err != nil {
			return nil, fmt.Errorf("%s queue of pool %s: %w", stage, pool, err)
		}
		for _, e := range engines {
			q.Waiting += e.NumPending
			q.Running += e.NumAckPending
			q.IdlePulls += e.NumWaiting
			q.Redelivered += e.NumRedelivered
		}
		out = append(out, q)
	}
	return out, nil
}

// DeadLetters counts the requests kept in PDQ_DLQ for replay.
func DeadLetters(ctx context.Context, js jetstream.JetStream) (uint64, error) {
	st, err := js.Stream(ctx, dispatcher.StreamDLQ)
	if err != nil {
		return 0, fmt.Errorf("dead-letter stream: %w", err)
	}
	return st.CachedInfo().State.Msgs, nil
}

// oldestWaiting is the age in seconds of the first job of pool's stage
// queue at or after stream sequence from (the first not yet delivered);
// 0 when it cannot be read.
func oldestWaiting(ctx context.Context, js jetstream.JetStream, stage dispatcher.Stage, pool string, from uint64) float64 {
	st, err := js.Stream(ctx, dispatcher.StageStream(stage))
	if err != nil {
		return 0
	}
	m, err := st.GetMsg(ctx, from, jetstream.WithGetMsgSubject(dispatcher.StageSubject(stage)+"."+pool+".>"))
	if err != nil {
		return 0
	}
	return time.Since(m.Time).Seconds()
}
