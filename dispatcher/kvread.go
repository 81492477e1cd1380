package dispatcher

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/internal/sleep"
)

// A prefill engine serves a request's KV blocks to one read: a second read
// fails, or reads blocks since freed and reused. pdq tells a handoff's
// first delivery from a redelivery, whose KV an earlier delivery may have
// read, by the consumer's delivery count. A nats-server killed and
// started again can forget a delivery and hand the job out again as a
// first one (issue 24: handoffs decoded twice after a restart), and a
// worker's ack sent into its reconnect buffer can reach the server after
// the job went to another worker. So whoever reads a handoff's KV, its
// decode or its release, first claims it in the pdq_kv_reads bucket, keyed
// by the request, its generation and the params (which name one prefill's
// blocks, but not always its request: NIXL v1 params carry no request id,
// and an engine reuses freed block ids): the first claim wins, and a
// delivery that finds the KV claimed by another takes it as read.
//
// It costs one write per decoded handoff. The bucket is file-stored, so
// that it outlives the restart it guards against. A claim need only outlive
// the handoff's KV: a handoff older than 1.1 times PDQ_KV_TTL is neither
// decoded nor released. So entries expire after kvReadsTTL, past any sane
// KV TTL (vLLM's lease is 30 s; its older abort timeout 480 s), and the
// bucket holds what 3,000 handoffs a second leave in that time.

const kvReadsTTL = 10 * time.Minute

// kvReadsBucketConfig is pdq_kv_reads.
func kvReadsBucketConfig(replicas int) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:      BucketKVReads,
		Description: "handoffs whose KV a decode or a release has claimed to read: one reader per prefill",
		TTL:         kvReadsTTL,
		Storage:     jetstream.FileStorage,
		History:     1,
		MaxBytes:    stageMaxBytes,
		Replicas:    max(replicas, 1),
	}
}

// KVReads claims handoffs' KV for one reader each.
type KVReads struct{ kv jetstream.KeyValue }

// OpenKVReads opens the pdq_kv_reads bucket.
func OpenKVReads(ctx context.Context, js jetstream.JetStream) (*KVReads, error) {
	kv, err := js.KeyValue(ctx, BucketKVReads)
	if err != nil {
		return nil, fmt.Errorf("open bucket %s: %w", BucketKVReads, err)
	}
	return &KVReads{kv: kv}, nil
}

// KVReadKey is the key of the KV that a handoff of job names.
func KVReadKey(job *Job) string {
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%d\x00", job.ID, job.Generation)
	h.Write(job.KV)
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// Claim reports whether reader holds the KV of job's handoff: it claimed
// it now, or had before. False means another reader has. A create that got
// no answer (the bucket's leader being elected again in a cluster) is tried
// again, up to ctx's end: one that was stored after all finds the key
// holding this reader's name, and stands.
func (r *KVReads) Claim(ctx context.Context, job *Job, reader string) (bool, error) {
	key := KVReadKey(job)
	_, err := r.kv.Create(ctx, key, []byte(reader))
	for NoAnswer(err) && ctx.Err() == nil {
		if sleep.For(ctx, publishRetryWait) != nil {
			break
		}
		_, err = r.kv.Create(ctx, key, []byte(reader))
	}
	if err == nil {
		return true, nil
	}
	if !errors.Is(err, jetstream.ErrKeyExists) {
		return false, fmt.Errorf("claim the handoff's KV: %w", err)
	}
	e, err := r.kv.Get(ctx, key)
	if err != nil {
		return false, fmt.Errorf("read the handoff's KV claim: %w", err)
	}
	return string(e.Value()) == reader, nil
}

// Unclaim gives back reader's claim of a read that did not happen: the
// handoff goes back to the queue, unread, for another reader.
func (r *KVReads) Unclaim(ctx context.Context, job *Job, reader string) error {
	key := KVReadKey(job)
	e, err := r.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read the handoff's KV claim: %w", err)
	}
	if string(e.Value()) != reader {
		return nil
	}
	if err := r.kv.Delete(ctx, key, jetstream.LastRevision(e.Revision())); err != nil {
		return fmt.Errorf("give back the handoff's KV claim: %w", err)
	}
	return nil
}
