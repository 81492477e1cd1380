package dispatcher

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// EnsureEngineConsumer returns the durable consumer of the jobs of stage
// and pool that prefer the engine keyed engine (see Job.Preferred), creating
// it when it is missing. Its engine's worker pulls from it before the
// pool's shared consumer; the pool's other workers take from it what
// waits there unpulled (see stage.Loop). It is removed after an hour
// without a pull or a job, as its engine is gone by then and its jobs
// taken by others.
func EnsureEngineConsumer(ctx context.Context, js jetstream.JetStream, stage Stage, pool, engine string, ackWait time.Duration, opts ...EnsureOption) (jetstream.Consumer, error) {
	if ackWait <= 0 {
		return nil, fmt.Errorf("%w: an ack wait must be positive, got %s", ErrInvalidOption, ackWait)
	}
	return ensureConsumer(ctx, js, StageStream(stage), jetstream.ConsumerConfig{
		Durable:           EngineConsumerName(stage, pool, engine),
		Description:       fmt.Sprintf("%s jobs of pool %s that prefer engine %s", stage, pool, engine),
		FilterSubject:     StageSubject(stage) + "." + pool + ".*." + engine,
		AckPolicy:         jetstream.AckExplicitPolicy,
		AckWait:           ackWait,
		MaxDeliver:        -1, // counted by the stage loop, as the shared consumer's
		MaxAckPending:     maxAckPending,
		MaxWaiting:        maxWaitingPulls,
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		InactiveThreshold: engineConsumerIdle,
	}, opts...)
}

// engineConsumerIdle is how long an engine's consumer lives without a
// pull or a job.
const engineConsumerIdle = time.Hour

// EngineConsumers lists the engine consumers of stage and pool, with
// their state, for the pool's workers to take over what waits in them.
func EngineConsumers(ctx context.Context, js jetstream.StreamManager, stage Stage, pool string) ([]*jetstream.ConsumerInfo, error) {
	all, err := PoolConsumers(ctx, js, stage, pool)
	if err != nil {
		return nil, err
	}
	shared := ConsumerName(stage, pool)
	out := all[:0]
	for _, info := range all {
		if info.Name != shared {
			out = append(out, info)
		}
	}
	return out, nil
}

// PoolConsumers lists the consumers that hold pool's jobs of stage: the
// shared one and the engines' (with affinity, most prefill jobs wait in
// the latter), one list request. An engine consumer counts only if its
// name and filter are exactly an engine's of this pool: pool "pdq"'s
// prefix also starts the names of pool "pdq-sim"'s consumers.
func PoolConsumers(ctx context.Context, js jetstream.StreamManager, stage Stage, pool string) ([]*jetstream.ConsumerInfo, error) {
	st, err := js.Stream(ctx, StageStream(stage))
	if err != nil {
		return nil, err
	}
	return PoolConsumersOf(ctx, st, stage, pool)
}

// PoolConsumersOf is PoolConsumers on stage's stream st, found before:
// one list request, without the stream info that finding it costs.
func PoolConsumersOf(ctx context.Context, st jetstream.Stream, stage Stage, pool string) ([]*jetstream.ConsumerInfo, error) {
	shared := ConsumerName(stage, pool)
	var out []*jetstream.ConsumerInfo
	list := st.ListConsumers(ctx)
	for info := range list.Info() {
		engine, ok := strings.CutPrefix(info.Name, shared+"-")
		if info.Name == shared || ok && IsEngineKey(engine) && info.Config.FilterSubject == StageSubject(stage)+"."+pool+".*."+engine {
			out = append(out, info)
		}
	}
	if err := list.Err(); err != nil {
		return nil, fmt.Errorf("list consumers of %s: %w", StageStream(stage), err)
	}
	return out, nil
}

// QueueDepth is how many of pool's jobs of stage wait undelivered, in its
// shared consumer and its engines'.
func QueueDepth(ctx context.Context, js jetstream.StreamManager, stage Stage, pool string) (int, error) {
	infos, err := PoolConsumers(ctx, js, stage, pool)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, info := range infos {
		n += int(info.NumPending)
	}
	return n, nil
}

// IsEngineKey says whether s is an EngineKey: "e" and ten hex digits.
func IsEngineKey(s string) bool {
	if len(s) != 11 || s[0] != 'e' {
		return false
	}
	for _, c := range s[1:] {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
