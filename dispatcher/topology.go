package dispatcher

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Topology settings. The stage streams are work queues: they hold only
// pending work, reject a second consumer over the same subjects, and are
// bounded with DiscardNew, so an overload becomes a 429 at the gateway
// instead of deleting queued work (see jetstream.md).
const (
	stageMaxBytes   = 1 << 30
	stageMaxAge     = time.Hour // a safety net; acked jobs are gone long before
	dedupWindow     = 2 * time.Minute
	maxMsgSize      = 8 << 20
	dlqMaxAge       = 7 * 24 * time.Hour
	dlqMaxBytes     = 1 << 30
	dlqMaxMsgs      = 10000
	releaseMaxBytes = 256 << 20
	workersTTL      = 30 * time.Second
	requestsTTL     = 24 * time.Hour
	maxAckPending   = 10000
	maxWaitingPulls = 512

	// DefaultMaxDeliver is how many deliveries of one job a stage runs
	// before the job fails for good (PDQ_MAX_DELIVER). The stage loop
	// counts them at pull, not the consumer: a consumer's own limit would
	// leave an exhausted message sitting in the work queue with nobody to
	// answer its client.
	DefaultMaxDeliver = 4
	// DefaultAckWait is how long a job may go without an ack or InProgress
	// before it is redelivered to another worker: a crashed worker's jobs
	// move on after this long. Running jobs send InProgress every third of
	// it.
	DefaultAckWait = 30 * time.Second
)

// Ensure creates the streams and buckets, or updates them to this
// configuration. It is idempotent; every component calls it at start-up.
func Ensure(ctx context.Context, js jetstream.JetStream) error {
	for _, cfg := range []jetstream.StreamConfig{
		stageStreamConfig(StreamPrefill, subjectPrefill+".>", "jobs waiting for a prefill worker"),
		stageStreamConfig(StreamDecode, subjectDecode+".>", "handoffs and decode-only jobs waiting for a decode worker"),
		{
			// Its own stream, so that a full PDQ_DECODE cannot also refuse
			// the release of the handoffs it refused.
			Name:        StreamRelease,
			Description: "handoffs that could not be stored, waiting for a decode worker to release their KV",
			Subjects:    []string{subjectRelease + ".>"},
			Retention:   jetstream.WorkQueuePolicy,
			Storage:     jetstream.FileStorage,
			MaxBytes:    releaseMaxBytes,
			Discard:     jetstream.DiscardNew,
			MaxAge:      5 * time.Minute, // a KV lease is 30 s: older releases are moot
			Duplicates:  dedupWindow,
			MaxMsgSize:  maxMsgSize,
		},
		{
			// Bounded by count and age; a full DLQ refuses new entries
			// rather than pushing out older failures. One entry per
			// request: its latest failure.
			Name:              StreamDLQ,
			Description:       "requests that failed for good, with stage and reason, for replay",
			Subjects:          []string{subjectDLQ + ".>"},
			Retention:         jetstream.LimitsPolicy,
			Storage:           jetstream.FileStorage,
			MaxAge:            dlqMaxAge,
			MaxBytes:          dlqMaxBytes,
			MaxMsgs:           dlqMaxMsgs,
			MaxMsgsPerSubject: 1,
			Discard:           jetstream.DiscardNew,
			MaxMsgSize:        maxMsgSize,
			AllowDirect:       true,
		},
	} {
		if _, err := js.CreateOrUpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("ensure stream %s: %w", cfg.Name, err)
		}
	}
	if _, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      BucketWorkers,
		Description: "live workers: role, pool, model, engine, slots, in-flight",
		TTL:         workersTTL,
		Storage:     jetstream.MemoryStorage,
		History:     1,
	}); err != nil {
		return fmt.Errorf("ensure bucket %s: %w", BucketWorkers, err)
	}
	if _, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:       BucketRequests,
		Description:  "request records by id: state, generation, stages, error, replay result",
		TTL:          requestsTTL,
		Storage:      jetstream.FileStorage,
		History:      1,
		MaxValueSize: maxMsgSize,
	}); err != nil {
		return fmt.Errorf("ensure bucket %s: %w", BucketRequests, err)
	}
	return nil
}

func stageStreamConfig(name, subjects, description string) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        name,
		Description: description,
		Subjects:    []string{subjects},
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     jetstream.FileStorage,
		MaxBytes:    stageMaxBytes,
		Discard:     jetstream.DiscardNew,
		MaxAge:      stageMaxAge,
		Duplicates:  dedupWindow,
		MaxMsgSize:  maxMsgSize,
		AllowDirect: true,
	}
}

// EnsureConsumer creates or updates the durable pull consumer that all
// workers of a stage and pool share; ackWait 0 takes DefaultAckWait.
func EnsureConsumer(ctx context.Context, js jetstream.JetStream, stage Stage, pool string, ackWait time.Duration) (jetstream.Consumer, error) {
	if ackWait <= 0 {
		ackWait = DefaultAckWait
	}
	name := ConsumerName(stage, pool)
	c, err := js.CreateOrUpdateConsumer(ctx, stageStream(stage), jetstream.ConsumerConfig{
		Durable:       name,
		Description:   fmt.Sprintf("%s workers of pool %s", stage, pool),
		FilterSubject: stageSubject(stage) + "." + pool + ".>",
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1, // counted by the stage loop: see DefaultMaxDeliver
		MaxAckPending: maxAckPending,
		MaxWaiting:    maxWaitingPulls,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return nil, fmt.Errorf("ensure consumer %s: %w", name, err)
	}
	return c, nil
}
