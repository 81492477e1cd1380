package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// Topology settings. The stage streams are work queues: they hold only
// pending work (and a keeper, dispatcher/pull/keeper.go), reject a second consumer over the same subjects, and are
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
)

// ErrInvalidOption is wrapped by the errors of options that reject their
// value.
var ErrInvalidOption = errors.New("invalid option")

// EnsureOption configures [Ensure], [EnsureConsumer] and [KeepEnsured].
type EnsureOption func(*ensureOptions) error

type ensureOptions struct {
	replicas int
	log      *slog.Logger
}

// WithReplicas sets the replicas of the streams and buckets Ensure creates
// (PDQ_NATS_REPLICAS): 1 on a single server, 3 in a 3-node cluster, so
// that losing a node loses no queue. Default 1.
func WithReplicas(n int) EnsureOption {
	return func(o *ensureOptions) error {
		if n < 1 || n > 5 {
			return fmt.Errorf("%w: replicas must be 1 to 5, got %d", ErrInvalidOption, n)
		}
		o.replicas = n
		return nil
	}
}

// WithLogger sets where a stream or consumer whose stored settings differ
// from this process's is reported. Default: nowhere.
func WithLogger(log *slog.Logger) EnsureOption {
	return func(o *ensureOptions) error {
		if log == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = log
		return nil
	}
}

func newEnsureOptions(opts []EnsureOption) (ensureOptions, error) {
	o := ensureOptions{replicas: 1, log: logging.Discard()}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return o, err
		}
	}
	return o, nil
}

// Ensure creates the streams and buckets that are missing. One owner for
// their settings: one that exists is left as it is, and where it differs
// from this process's settings in one pdq relies on, a warning names the
// setting, the stored and the wanted value. (Updating it instead would let
// the last process to start, with whatever configuration it has, change
// the settings for all.) To change a setting, edit the stream (nats stream
// edit) or delete it while pdq is stopped. Every component calls Ensure at
// start-up, and again after every reconnect (see [KeepEnsured]).
func Ensure(ctx context.Context, js jetstream.JetStream, opts ...EnsureOption) error {
	o, err := newEnsureOptions(opts)
	if err != nil {
		return err
	}
	for _, cfg := range streamConfigs(o.replicas) {
		if err := ensureStream(ctx, js, cfg, o.log); err != nil {
			return err
		}
	}
	for _, cfg := range []jetstream.KeyValueConfig{WorkersBucketConfig(o.replicas), requestsBucketConfig(o.replicas), kvReadsBucketConfig(o.replicas)} {
		if err := ensureBucket(ctx, js, cfg, o.log); err != nil {
			return err
		}
	}
	return nil
}

// KeepEnsured runs Ensure again each time the connection under js comes
// back, until ctx ends: a server restarted without its store, or one that
// lost the memory bucket pdq_workers in its restart, gets pdq's streams and
// buckets back before anyone needs them. (Consumers are the stage loops'
// own: a loop whose pulls fail creates its consumer again.) An attempt
// that fails, for instance while a cluster elects a leader, is retried.
func KeepEnsured(ctx context.Context, js jetstream.JetStream, opts ...EnsureOption) error {
	o, err := newEnsureOptions(opts)
	if err != nil {
		return err
	}
	nc := js.Conn()
	status := nc.StatusChanged(nats.CONNECTED)
	defer nc.RemoveStatusListener(status)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-status:
		}
		for wait := 250 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
			ectx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := Ensure(ectx, js, opts...)
			cancel()
			if err == nil {
				o.log.Debug("streams and buckets checked after a reconnect")
				break
			}
			if ctx.Err() != nil {
				return nil
			}
			o.log.Warn("could not check the streams and buckets after a reconnect; retrying", logging.Err(err),
				"retry_in", wait.String())
			if sleep.For(ctx, wait) != nil {
				return nil
			}
		}
	}
}

// errCodeClusterNotAvailable is JetStream's "JetStream system temporarily
// unavailable": a cluster, or a stream's or consumer's group, without a
// leader for longer than the servers wait before saying so.
const errCodeClusterNotAvailable = 10008

// Unanswered reports whether a JetStream call failed for want of an answer
// ([NoAnswer]) or was put off by a cluster without a leader, rather than
// refused: asked again, it may succeed.
func Unanswered(err error) bool {
	var apiErr *jetstream.APIError
	return NoAnswer(err) || errors.As(err, &apiErr) && apiErr.ErrorCode == errCodeClusterNotAvailable
}

// UntilAnswered runs op, the JetStream look-ups a process needs before it
// can serve, until it succeeds, is refused or ctx ends; an attempt that is
// [Unanswered] is logged with what and tried again, 250 ms later, then
// twice as long each time up to 5 s. Waiting is right: a server drops, with
// no answer, a request for a stream or consumer whose group is electing its
// leader, as every new one does, and two workers of a pool starting
// together meet this (one creates their consumer while the other asks for
// its info, which went unanswered for 5 s and ended the worker). When ctx
// ends it returns op's last error.
func UntilAnswered(ctx context.Context, log *slog.Logger, what string, op func(context.Context) error) error {
	for wait := 250 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		err := op(ctx)
		if err == nil || !Unanswered(err) || ctx.Err() != nil {
			return err
		}
		log.Warn("JetStream did not answer; retrying (a stream or consumer may be electing its leader)", "for", what,
			logging.Err(err), "retry_in", wait.String())
		if sleep.For(ctx, wait) != nil {
			return err
		}
	}
}

// streamConfigs are pdq's streams, each with replicas copies.
func streamConfigs(replicas int) []jetstream.StreamConfig {
	return []jetstream.StreamConfig{
		stageStreamConfig(StreamPrefill, SubjectPrefill+".>", "jobs waiting for a prefill worker", replicas),
		stageStreamConfig(StreamDecode, SubjectDecode+".>", "handoffs and decode-only jobs waiting for a decode worker", replicas),
		{
			// Its own stream, so that a full PDQ_DECODE cannot also refuse
			// the release of the handoffs it refused.
			Name:        StreamRelease,
			Description: "handoffs that could not be stored, waiting for a decode worker to release their KV",
			Subjects:    []string{SubjectRelease + ".>"},
			Retention:   jetstream.WorkQueuePolicy,
			Storage:     jetstream.FileStorage,
			MaxBytes:    releaseMaxBytes,
			Discard:     jetstream.DiscardNew,
			MaxAge:      5 * time.Minute, // a KV lease is 30 s: older releases are moot
			Duplicates:  dedupWindow,
			MaxMsgSize:  maxMsgSize,
			Replicas:    replicas,
		},
		{
			// Bounded by count and age; a full DLQ refuses new entries
			// rather than pushing out older failures. One entry per
			// request: its latest failure.
			Name:              StreamDLQ,
			Description:       "requests that failed for good, with stage and reason, for replay",
			Subjects:          []string{SubjectDLQ + ".>"},
			Retention:         jetstream.LimitsPolicy,
			Storage:           jetstream.FileStorage,
			MaxAge:            dlqMaxAge,
			MaxBytes:          dlqMaxBytes,
			MaxMsgs:           dlqMaxMsgs,
			MaxMsgsPerSubject: 1,
			Discard:           jetstream.DiscardNew,
			MaxMsgSize:        maxMsgSize,
			AllowDirect:       true,
			Replicas:          replicas,
		},
	}
}

func stageStreamConfig(name, subjects, description string, replicas int) jetstream.StreamConfig {
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
		Replicas:    replicas,
	}
}

// WorkersBucketConfig is pdq_workers: memory storage, since its entries
// live for seconds; a restarted server has lost it, and the first process
// to notice creates it again.
func WorkersBucketConfig(replicas int) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:      BucketWorkers,
		Description: "live workers: role, pool, model, engine, slots, in-flight",
		TTL:         workersTTL,
		Storage:     jetstream.MemoryStorage,
		History:     1,
		Replicas:    max(replicas, 1),
	}
}

func requestsBucketConfig(replicas int) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:       BucketRequests,
		Description:  "request records by id: state, generation, stages, error, replay result",
		TTL:          requestsTTL,
		Storage:      jetstream.FileStorage,
		History:      1,
		MaxValueSize: maxMsgSize,
		Replicas:     max(replicas, 1),
	}
}

// ensureStream creates cfg's stream unless it exists. It looks first: a
// create with other settings fails in ways that depend on the setting (a
// single server refuses replicas before it says the name is taken).
func ensureStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig, log *slog.Logger) error {
	st, err := js.Stream(ctx, cfg.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if _, err = js.CreateStream(ctx, cfg); err == nil {
			return nil
		}
		if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) { // else another process was first
			return fmt.Errorf("create stream %s (%d replicas): %w", cfg.Name, max(cfg.Replicas, 1), err)
		}
		st, err = js.Stream(ctx, cfg.Name)
	}
	if err != nil {
		return fmt.Errorf("stream %s: %w", cfg.Name, err)
	}
	warnSettings(log, "stream", cfg.Name, streamDiffs(st.CachedInfo().Config, cfg))
	return nil
}

// ensureBucket creates cfg's bucket unless it exists.
func ensureBucket(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig, log *slog.Logger) error {
	stream := "KV_" + cfg.Bucket
	st, err := js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if _, err = js.CreateKeyValue(ctx, cfg); err == nil {
			return nil
		}
		if !errors.Is(err, jetstream.ErrBucketExists) {
			return fmt.Errorf("create bucket %s (%d replicas): %w", cfg.Bucket, max(cfg.Replicas, 1), err)
		}
		st, err = js.Stream(ctx, stream)
	}
	if err != nil {
		return fmt.Errorf("bucket %s: %w", cfg.Bucket, err)
	}
	warnSettings(log, "bucket", cfg.Bucket, bucketDiffs(st.CachedInfo().Config, cfg))
	return nil
}

// setting is one stored setting that differs from this process's.
type setting struct {
	name           string
	stored, wanted any
}

// differ collects the settings whose stored and wanted values differ.
type differ []setting

func (d *differ) add(name string, stored, wanted any) {
	if !reflect.DeepEqual(stored, wanted) {
		*d = append(*d, setting{name, stored, wanted})
	}
}

// limit normalizes a limit: the server stores "none" as -1 where a config
// may say 0.
func limit[T int64 | int32](v T) string {
	if v <= 0 {
		return "unlimited"
	}
	return fmt.Sprint(v)
}

func streamDiffs(stored, wanted jetstream.StreamConfig) []setting {
	var d differ
	d.add("subjects", stored.Subjects, wanted.Subjects)
	d.add("retention", stored.Retention.String(), wanted.Retention.String())
	d.add("storage", stored.Storage.String(), wanted.Storage.String())
	d.add("discard", stored.Discard.String(), wanted.Discard.String())
	d.add("max_bytes", limit(stored.MaxBytes), limit(wanted.MaxBytes))
	d.add("max_msgs", limit(stored.MaxMsgs), limit(wanted.MaxMsgs))
	d.add("max_msgs_per_subject", limit(stored.MaxMsgsPerSubject), limit(wanted.MaxMsgsPerSubject))
	d.add("max_msg_size", limit(stored.MaxMsgSize), limit(wanted.MaxMsgSize))
	d.add("max_age", stored.MaxAge.String(), wanted.MaxAge.String())
	if wanted.Duplicates > 0 {
		d.add("duplicate_window", stored.Duplicates.String(), wanted.Duplicates.String())
	}
	d.add("allow_direct", stored.AllowDirect, wanted.AllowDirect)
	d.add("replicas", max(stored.Replicas, 1), max(wanted.Replicas, 1))
	return d
}

func bucketDiffs(stored jetstream.StreamConfig, wanted jetstream.KeyValueConfig) []setting {
	var d differ
	d.add("ttl", stored.MaxAge.String(), wanted.TTL.String())
	d.add("history", limit(stored.MaxMsgsPerSubject), limit(int64(max(wanted.History, 1))))
	d.add("storage", stored.Storage.String(), wanted.Storage.String())
	d.add("max_value_size", limit(stored.MaxMsgSize), limit(wanted.MaxValueSize))
	d.add("replicas", max(stored.Replicas, 1), max(wanted.Replicas, 1))
	// The KeyValue client creates buckets with direct gets allowed; pdq's
	// reads of records rely on them (a bucket without them falls back on
	// the KeyValue's Get: two requests a read).
	d.add("allow_direct", stored.AllowDirect, true)
	return d
}

func consumerDiffs(stored, wanted jetstream.ConsumerConfig) []setting {
	var d differ
	d.add("filter_subject", stored.FilterSubject, wanted.FilterSubject)
	d.add("ack_policy", stored.AckPolicy.String(), wanted.AckPolicy.String())
	d.add("ack_wait", stored.AckWait.String(), wanted.AckWait.String())
	d.add("max_deliver", limit(int64(stored.MaxDeliver)), limit(int64(wanted.MaxDeliver)))
	if wanted.MaxAckPending > 0 {
		d.add("max_ack_pending", stored.MaxAckPending, wanted.MaxAckPending)
	}
	if wanted.MaxWaiting > 0 {
		d.add("max_waiting", stored.MaxWaiting, wanted.MaxWaiting)
	}
	d.add("deliver_policy", stored.DeliverPolicy.String(), wanted.DeliverPolicy.String())
	return d
}

// warnSettings reports each stored setting that differs from this
// process's; the stored one stays in force.
func warnSettings(log *slog.Logger, kind, name string, diffs []setting) {
	for _, s := range diffs {
		log.Warn("a "+kind+" setting differs from this process's; keeping the stored value (one owner: it is never overwritten)",
			kind, name, "setting", s.name, "stored", fmt.Sprint(s.stored), "wanted", fmt.Sprint(s.wanted))
	}
}

// EnsureConsumer returns the durable pull consumer that all workers of a
// stage and pool share, creating it when it is missing, with ackWait
// (PDQ_ACK_WAIT). One that exists keeps its settings: see [Ensure].
func EnsureConsumer(ctx context.Context, js jetstream.JetStream, stage Stage, pool string, ackWait time.Duration, opts ...EnsureOption) (jetstream.Consumer, error) {
	if ackWait <= 0 {
		return nil, fmt.Errorf("%w: an ack wait must be positive, got %s", ErrInvalidOption, ackWait)
	}
	cfg := jetstream.ConsumerConfig{
		Durable:       ConsumerName(stage, pool),
		Description:   fmt.Sprintf("%s workers of pool %s", stage, pool),
		FilterSubject: StageSubject(stage) + "." + pool + ".*", // not the jobs that prefer an engine: see PreferredSubject
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1, // counted by the stage loop: see stage.Config.MaxDeliver
		MaxAckPending: maxAckPending,
		MaxWaiting:    maxWaitingPulls,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	c, err := ensureConsumer(ctx, js, StageStream(stage), cfg, opts...)
	if err == nil && c.CachedInfo().Config.FilterSubject == StageSubject(stage)+"."+pool+".>" {
		// Made by a build before prefix-cache affinity: its filter would
		// overlap the engines' consumers, which a work queue refuses.
		if c, err = js.UpdateConsumer(ctx, StageStream(stage), withFilter(c.CachedInfo().Config, cfg.FilterSubject)); err != nil {
			err = fmt.Errorf("narrow the filter of consumer %s: %w", cfg.Durable, err)
		}
	}
	return c, err
}

func withFilter(cfg jetstream.ConsumerConfig, filter string) jetstream.ConsumerConfig {
	cfg.FilterSubject = filter
	return cfg
}

// EnsureReleaseConsumer returns the durable consumer of pool's release
// queue, creating it when it is missing.
func EnsureReleaseConsumer(ctx context.Context, js jetstream.JetStream, pool string, ackWait time.Duration, maxDeliver int, opts ...EnsureOption) (jetstream.Consumer, error) {
	return ensureConsumer(ctx, js, StreamRelease, jetstream.ConsumerConfig{
		Durable:       releaseConsumer(pool),
		Description:   "decode workers of pool " + pool + " releasing KV of handoffs never stored",
		FilterSubject: SubjectRelease + "." + pool + ".>",
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    maxDeliver,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}, opts...)
}

func ensureConsumer(ctx context.Context, js jetstream.JetStream, stream string, cfg jetstream.ConsumerConfig, opts ...EnsureOption) (jetstream.Consumer, error) {
	o, err := newEnsureOptions(opts)
	if err != nil {
		return nil, err
	}
	c, err := js.Consumer(ctx, stream, cfg.Durable)
	switch {
	case err == nil:
		warnSettings(o.log, "consumer", cfg.Durable, consumerDiffs(c.CachedInfo().Config, cfg))
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		c, err = js.CreateConsumer(ctx, stream, cfg)
		if errors.Is(err, jetstream.ErrConsumerExists) { // another worker was first
			if c, err = js.Consumer(ctx, stream, cfg.Durable); err == nil {
				warnSettings(o.log, "consumer", cfg.Durable, consumerDiffs(c.CachedInfo().Config, cfg))
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("ensure consumer %s: %w", cfg.Durable, err)
	}
	return c, nil
}

// releaseConsumer is the durable consumer of a pool's release queue.
func releaseConsumer(pool string) string { return "release-" + pool }
