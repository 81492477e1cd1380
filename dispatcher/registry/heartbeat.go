package registry

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// Worker heartbeats. A worker publishes its WorkerInfo on WorkerSubject(id)
// every HeartbeatInterval, at once when a registry asks on
// WorkersAskSubject (a gateway that starts or reconnects), and at once
// when its own connection comes back; a stopping worker says so with
// HeaderLeaving. Core NATS, not the bucket, carries them to the
// registries: a core subscription is sent again on every reconnect, while
// a watch on a memory bucket ends with the bucket when a NATS server
// restarts. The worker also writes its entry to the pdq_workers bucket, for
// operators and tools, and recreates the bucket when it finds it missing.

// Heartbeat keeps a worker heard until ctx ends, then says it is leaving
// so that registries stop counting it at once. info is the worker's
// entry; fill sets what changes in it (its load, its breaker) before each
// beat, and returns a channel that closes when the breaker changes (or
// nil). A decode worker (watch) also tells the registries at once when its
// seats change or its average job time moves, for the decode gates.
// replicas is the bucket's, should the heartbeat have to recreate it.
func Heartbeat(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, replicas int, info dispatcher.WorkerInfo,
	fill func(*dispatcher.WorkerInfo) <-chan struct{}, watch bool, log *slog.Logger) {
	now := make(chan struct{}, 1)
	poke := func() {
		select {
		case now <- struct{}{}:
		default:
		}
	}
	ask, err := nc.Subscribe(dispatcher.WorkersAskSubject, func(*nats.Msg) { poke() })
	if err != nil {
		log.Warn("cannot hear registries ask for heartbeats; they hear this worker within 2s anyway", logging.Err(err))
	} else {
		defer ask.Unsubscribe()
	}
	status := nc.StatusChanged(nats.CONNECTED)
	defer nc.RemoveStatusListener(status)
	bucket := &workersBucket{js: js, replicas: replicas}
	var healthChanged <-chan struct{}
	// beat sends the entry; an early one (news for the decode gates
	// before the next heartbeat) skips the bucket, which only operators
	// read.
	beat := func(early bool) {
		healthChanged = fill(&info)
		data, err := json.Marshal(info)
		if err != nil {
			log.Error("encode heartbeat", logging.Err(err))
			return
		}
		if err := nc.Publish(dispatcher.WorkerSubject(info.ID), data); err != nil {
			log.Warn("heartbeat not sent", logging.Err(err))
		}
		if early {
			return
		}
		pctx, cancel := context.WithTimeout(ctx, dispatcher.HeartbeatInterval)
		defer cancel()
		if err := bucket.put(pctx, info.ID, data); err != nil && ctx.Err() == nil {
			// Registries do not read the bucket: this only leaves the
			// operators' view stale.
			level := slog.LevelDebug // NATS is down: the log says so already
			if nc.IsConnected() {
				level = slog.LevelWarn
			}
			log.Log(ctx, level, "registry bucket not written", logging.Err(err))
		}
	}
	beat(false)
	t := time.NewTicker(dispatcher.HeartbeatInterval)
	defer t.Stop()
	// The decode gates count on a decode worker's seats and average job
	// time: a change is news before the next heartbeat.
	var check <-chan time.Time
	if watch {
		tc := time.NewTicker(avgCheck)
		defer tc.Stop()
		check = tc.C
	}
	for {
		select {
		case <-t.C:
		case <-check:
			now := info
			fill(&now)
			if now.Seats != info.Seats || moved(info.AvgJobMs, now.AvgJobMs) {
				beat(true)
			}
			continue
		case <-now:
		case <-status:
		case <-healthChanged: // a breaker that opens or closes is news at once
		case <-ctx.Done():
			leave(context.WithoutCancel(ctx), nc, info.ID, bucket, log)
			return
		}
		beat(false)
	}
}

// leave tells the registries that this worker stops, and removes its
// bucket entry.
func leave(ctx context.Context, nc *nats.Conn, id string, bucket *workersBucket, log *slog.Logger) {
	m := nats.NewMsg(dispatcher.WorkerSubject(id))
	m.Header.Set(dispatcher.HeaderLeaving, "true")
	err := nc.PublishMsg(m)
	if err == nil {
		err = nc.FlushTimeout(time.Second)
	}
	if err != nil {
		log.Debug("leaving message not sent; registries count this worker gone once its heartbeats stop", logging.Err(err))
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := bucket.delete(dctx, id); err != nil {
		log.Warn("could not remove this worker from the registry bucket; it expires on its own", logging.Err(err))
	}
}

// workersBucket writes a worker's entry in pdq_workers, recreating the
// bucket when a NATS restart lost it (it is memory storage).
type workersBucket struct {
	js       jetstream.JetStream
	replicas int
	kv       jetstream.KeyValue
}

func (b *workersBucket) put(ctx context.Context, id string, data []byte) error {
	if b.kv == nil {
		kv, err := b.js.KeyValue(ctx, dispatcher.BucketWorkers)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			kv, err = b.js.CreateKeyValue(ctx, dispatcher.WorkersBucketConfig(b.replicas))
			if errors.Is(err, jetstream.ErrBucketExists) { // another process was first
				kv, err = b.js.KeyValue(ctx, dispatcher.BucketWorkers)
			}
		}
		if err != nil {
			return err
		}
		b.kv = kv
	}
	_, err := b.kv.Put(ctx, id, data)
	if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrStreamNotFound) {
		b.kv = nil // the bucket is gone: look it up, or make it, next time
	}
	return err
}

func (b *workersBucket) delete(ctx context.Context, id string) error {
	if b.kv == nil {
		return nil
	}
	return b.kv.Delete(ctx, id)
}

// avgCheck is how often a decode worker looks whether its seats changed,
// or its average job time moved enough, to tell the registries before the
// next heartbeat.
const avgCheck = 250 * time.Millisecond

// moved reports whether an average went from was to now by more than half
// up, or a third down (back to where half up would have come from).
func moved(was, now float64) bool {
	return now != was && (now < was*2/3 || now > was*3/2)
}
