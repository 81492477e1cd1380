package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// bucketDoctor holds the rebuilds under way, one key a stream: one
// gateway rebuilds a stream at a time. Memory storage, so that it takes
// writes while the disk is full; made when first needed.
const bucketDoctor = "pdq_doctor"

// lockTTL is how long a rebuild's lock lasts at most: a gateway killed
// while it rebuilds leaves the stream to the others after it. Reading a
// stream of gigabytes may take longer: another gateway may then rebuild
// it too, and the checks before the delete are all that stop it.
const lockTTL = 10 * time.Minute

// lock takes the rebuild of stream for this doctor, until unlock, or
// lockTTL.
func (d *StoreDoctor) lock(ctx context.Context, stream string) (unlock func(), ok bool) {
	lctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	kv, err := d.js.KeyValue(lctx, bucketDoctor)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = d.js.CreateKeyValue(lctx, jetstream.KeyValueConfig{Bucket: bucketDoctor,
			Description: "streams a gateway's store doctor is rebuilding", TTL: lockTTL,
			Storage: jetstream.MemoryStorage, History: 1})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = d.js.KeyValue(lctx, bucketDoctor)
		}
	}
	if err != nil {
		d.log.Warn("could not take the rebuild of a stream", "stream", stream, logging.Err(err))
		return nil, false
	}
	rev, err := kv.Create(lctx, stream, []byte(d.id))
	if err != nil {
		if !errors.Is(err, jetstream.ErrKeyExists) {
			d.log.Warn("could not take the rebuild of a stream", "stream", stream, logging.Err(err))
		}
		return nil, false
	}
	return func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), probeWait)
		defer cancel()
		if err := kv.Delete(uctx, stream, jetstream.LastRevision(rev)); err != nil {
			d.log.Warn("could not give back the rebuild of a stream: another gateway may take it when it expires", "stream", stream, logging.Err(err))
		}
	}, true
}

// canWrite reports whether the store can write a new file store: a stream
// made for the test, given a message, and deleted. It fails while the
// disk is full.
func (d *StoreDoctor) canWrite(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 2*probeWait)
	defer cancel()
	name := "PDQ_PROBE_" + dispatcher.Token()
	subject := "pdq.probe." + strings.ToLower(name)
	if _, err := d.js.CreateStream(cctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject},
		Storage: jetstream.FileStorage, MaxBytes: 1 << 20, MaxAge: time.Minute}); err != nil {
		return fmt.Errorf("create a stream: %w", err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*probeWait)
		defer cancel()
		if err := d.js.DeleteStream(dctx, name); err != nil {
			d.log.Warn("could not delete the stream made to test the store; delete it by hand", "stream", name, logging.Err(err))
		}
	}()
	if _, err := d.js.Publish(cctx, subject, []byte("probe"), jetstream.WithRetryAttempts(0)); err != nil {
		return fmt.Errorf("store a message: %w", err)
	}
	return nil
}

// rebuildWait bounds a rebuild's making the stream anew and storing its
// messages again, whatever becomes of the gateway meanwhile: the stream
// is gone from the moment it is deleted.
const rebuildWait = time.Minute

// rebuild reads what matters of t's stream, deletes it, creates it anew
// with its settings, and stores what it read again. It stops before the
// delete if the stream is not latched after all: several replicas, a
// probe that it answers now, or a message stored while it was read (a
// latched store stores nothing).
func (d *StoreDoctor) rebuild(ctx context.Context, t storeTarget) error {
	start := time.Now()
	st, err := d.js.Stream(ctx, t.stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", t.stream, err)
	}
	info := st.CachedInfo()
	if info.Config.Replicas > 1 {
		return fmt.Errorf("stream %s has %d replicas: not rebuilt (another replica takes over from one whose store latched)", t.stream, info.Config.Replicas)
	}
	kept, read, err := d.collect(ctx, st, info, t)
	if err != nil {
		return err
	}
	if stores, err := ProbeStore(ctx, d.js, t.stream, t.probe); stores || !errors.Is(err, dispatcher.ErrNotStoring) {
		return fmt.Errorf("stream %s stores, or cannot be asked, after all: not rebuilt (%v)", t.stream, err)
	}
	now, err := d.js.Stream(ctx, t.stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", t.stream, err)
	}
	if ni := now.CachedInfo(); !ni.Created.Equal(info.Created) || ni.State.LastSeq != info.State.LastSeq {
		return fmt.Errorf("stream %s changed while it was read (stored a message, or rebuilt elsewhere): not rebuilt", t.stream)
	}
	return d.remake(ctx, t, info, kept, read, start)
}

// remake deletes t's stream, creates it anew with info's settings, and
// stores kept in it again.
func (d *StoreDoctor) remake(ctx context.Context, t storeTarget, info *jetstream.StreamInfo, kept []*jetstream.RawStreamMsg, read int, start time.Time) error {
	if err := d.js.DeleteStream(ctx, t.stream); err != nil {
		return fmt.Errorf("delete stream %s: %w", t.stream, err)
	}
	// From here on the stream is gone: make it and store its messages
	// again whatever happens to ctx.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rebuildWait)
	defer cancel()
	cfg := info.Config
	// Sequences, and so a bucket's revisions, go on from the old stream's:
	// an ack of an old delivery, or a revision read before, must not meet
	// a message of the new stream under the same number.
	cfg.FirstSeq = info.State.LastSeq + 1
	b := backoff.WithContext(backoff.NewExponentialBackOff(), wctx)
	if err := backoff.Retry(func() error {
		_, err := d.js.CreateStream(wctx, cfg)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Made meanwhile (a process that found it missing), perhaps
			// from sequence 1: an empty one goes on from the old stream's.
			return d.goOn(wctx, t.stream, cfg.FirstSeq)
		}
		return err
	}, b); err != nil {
		return fmt.Errorf("create stream %s anew (its %d messages kept are lost): %w", t.stream, len(kept), err)
	}
	lost := 0
	for _, m := range kept {
		msg := &nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data}
		for _, h := range republishDropped() {
			msg.Header.Del(h)
		}
		if t.keep == keepLiveJobs {
			msg.Header.Set(dispatcher.HeaderRebuilt, "true")
		}
		if _, err := d.js.PublishMsg(wctx, msg); err != nil {
			lost++
			d.log.Warn("a message of a rebuilt stream could not be stored again", "stream", t.stream, "subject", m.Subject, logging.Err(err))
		}
	}
	d.log.Warn("rebuilt a stream whose store did not write", "stream", t.stream, "messages_read", read,
		"messages_kept", len(kept)-lost, "lost", lost, logging.Ms("took_ms", time.Since(start)))
	return nil
}

// goOn makes an empty stream's sequences go on from first; a stream that
// holds messages numbered below it is left as it is, and said.
func (d *StoreDoctor) goOn(ctx context.Context, stream string, first uint64) error {
	st, err := d.js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	state := st.CachedInfo().State
	switch {
	case state.LastSeq+1 >= first:
	case state.Msgs == 0:
		if err := st.Purge(ctx, jetstream.WithPurgeSequence(first)); err != nil {
			return fmt.Errorf("number stream %s on from %d: %w", stream, first, err)
		}
	default:
		d.log.Warn("a stream made anew elsewhere holds messages numbered below the old stream's: a late ack of an old delivery may settle one of them", "stream", stream)
	}
	return nil
}

// republishDropped are the headers a message read back is stored again
// without: the expectations it was first published with, which the new
// stream would check against its own sequences, and those a direct get
// adds to its answer. A stored Nats-Sequence would stand before the one
// a later direct get adds: a record's revision read wrong, and every
// write of it refused.
func republishDropped() []string {
	return []string{
		jetstream.ExpectedStreamHeader, jetstream.ExpectedLastSeqHeader, jetstream.ExpectedLastSubjSeqHeader,
		jetstream.ExpectedLastSubjSeqSubjHeader, jetstream.ExpectedLastMsgIDHeader,
		jetstream.StreamHeader, jetstream.SequenceHeader, jetstream.TimeStampHeaer, jetstream.SubjectHeader,
		"Nats-Num-Pending", "Nats-Last-Sequence", "Nats-UpTo-Sequence",
	}
}

// collect reads the stream's messages, and returns those to keep. It asks
// for each next message, so the gaps acked jobs left cost nothing.
func (d *StoreDoctor) collect(ctx context.Context, st jetstream.Stream, info *jetstream.StreamInfo, t storeTarget) (kept []*jetstream.RawStreamMsg, read int, err error) {
	k := t.keep
	var acked map[string]uint64 // each consumer's filter: its ack floor
	if k != keepLatest {
		if acked, err = ackFloors(ctx, st); err != nil {
			return nil, 0, err
		}
	}
	latest := make(map[string]int) // subject → index in kept, for keepLatest
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(">"))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break // none after seq
		}
		if err != nil {
			return nil, read, fmt.Errorf("read %s message %d: %w", info.Config.Name, seq, err)
		}
		seq = m.Sequence
		if seq > info.State.LastSeq {
			break
		}
		read++
		if m.Subject == t.probe {
			continue
		}
		switch k {
		case keepAll:
			if floor, ok := ackFloorOf(acked, m.Subject); !ok || seq > floor {
				kept = append(kept, m)
			}
		case keepLatest:
			if i, ok := latest[m.Subject]; ok {
				kept[i] = nil
				delete(latest, m.Subject)
			}
			if op := m.Header.Get(dispatcher.KVOperation); op == "" {
				latest[m.Subject] = len(kept)
				kept = append(kept, m)
			}
		case keepLiveJobs:
			if floor, ok := ackFloorOf(acked, m.Subject); ok && seq <= floor {
				continue // acked: its removal is what the store failed to write
			}
			if d.live(ctx, m) {
				kept = append(kept, m)
			}
		}
	}
	out := kept[:0]
	for _, m := range kept {
		if m != nil {
			out = append(out, m)
		}
	}
	return out, read, nil
}

// ackFloors maps each consumer's filter subject to its ack floor: every
// message of the filter at or below it was acked.
func ackFloors(ctx context.Context, st jetstream.Stream) (map[string]uint64, error) {
	floors := make(map[string]uint64)
	list := st.ListConsumers(ctx)
	for ci := range list.Info() {
		floors[ci.Config.FilterSubject] = ci.AckFloor.Stream
	}
	if err := list.Err(); err != nil {
		return nil, fmt.Errorf("list the consumers of %s: %w", st.CachedInfo().Config.Name, err)
	}
	return floors, nil
}

// ackFloorOf is the ack floor of the consumer whose filter a job's subject
// falls under: pdq.<stage>.<pool>.* for pdq.<stage>.<pool>.<id> (the
// pool's shared consumer), pdq.<stage>.<pool>.*.<engine> for a job that
// prefers an engine (the engine's), or pdq.<stage>.<pool>.> (a consumer
// of a build before affinity, not narrowed yet).
func ackFloorOf(floors map[string]uint64, subject string) (uint64, bool) {
	tokens := strings.Split(subject, ".")
	if len(tokens) < 4 {
		return 0, false
	}
	pool := strings.Join(tokens[:3], ".")
	filter := pool + ".*"
	if len(tokens) == 5 {
		filter += "." + tokens[4]
	}
	if floor, ok := floors[filter]; ok {
		return floor, true
	}
	floor, ok := floors[pool+".>"]
	return floor, ok
}

// live reports whether a stored job's request is still live at the job's
// generation; a message that is not a job (a probe) is not.
func (d *StoreDoctor) live(ctx context.Context, m *jetstream.RawStreamMsg) bool {
	job, err := dispatcher.ParseJob(m.Header, m.Data)
	if err != nil || job.ID == "" {
		return false
	}
	r, _, err := d.records.Get(ctx, job.ID)
	if errors.Is(err, dispatcher.ErrNoRecord) {
		return false
	}
	if err != nil {
		return true // not known: keep it, its pull checks it again
	}
	return r.Live() && r.Generation <= job.Generation
}
