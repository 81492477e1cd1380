package admin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// The store doctor. A nats-server whose disk fills while it writes a
// stream's file store latches the write error in that store: the stream
// stops answering publishes, and its acked messages, whose removal is a
// write, stay; nothing but a restart of the server clears the latch, not
// even freeing space. pdq's streams and buckets must take writes for any
// request to be served, so the doctor looks at each one's writes, says
// when one does not store (for /ready, the metrics, pdq status), and once
// the store can write again rebuilds it: it reads the messages that still
// matter, deletes the stream, creates it anew with the same settings (a
// new store, without the latch) and stores them again. What it keeps is
// what pdq's checks would act on: a job whose request is still live at its
// generation and that its consumer has not acked, a bucket's latest value
// of each key, every release. A job stored again is marked (HeaderRebuilt)
// and judged as a redelivery: a delivery still running meets it, and the
// checks for a redelivery apply (records, the handoff stored, the running
// query, the KV claims). Only a stream of one replica is rebuilt: a
// replica whose store latched steps down, and another leads.

// doctorEvery is how often the doctor probes each store.
const doctorEvery = 5 * time.Second

// probeWait is how long a probe waits for the server to store it.
const probeWait = 2 * time.Second

// brokenLooks is how many probes in a row must find a stream not storing,
// while the server answers, before the doctor rebuilds it: one may be a
// busy moment.
const brokenLooks = 2

// keep decides what a rebuild stores again of a stream's messages.
type keep int

const (
	keepLiveJobs keep = iota // jobs whose request is live at their generation
	keepLatest               // a bucket's last value of each key (none for a deleted one)
	keepAll
)

// storeTarget is one of pdq's file streams the doctor watches: where its
// probe goes, and what a rebuild keeps.
type storeTarget struct {
	stream, probe string
	keep          keep
}

// storeTargets are the file streams every request writes to, the buckets
// first: a rebuild of a stage stream asks the records which jobs are live.
func storeTargets() []storeTarget {
	return []storeTarget{
		{stream: "KV_" + dispatcher.BucketRequests, probe: "$KV." + dispatcher.BucketRequests + "." + probeKey, keep: keepLatest},
		{stream: "KV_" + dispatcher.BucketKVReads, probe: "$KV." + dispatcher.BucketKVReads + "." + probeKey, keep: keepLatest},
		{stream: dispatcher.StreamPrefill, probe: dispatcher.SubjectPrefill + "." + probeToken, keep: keepLiveJobs},
		{stream: dispatcher.StreamDecode, probe: dispatcher.SubjectDecode + "." + probeToken, keep: keepLiveJobs},
		{stream: dispatcher.StreamRelease, probe: dispatcher.SubjectRelease + "." + probeToken, keep: keepAll},
	}
}

// A stream's probe subject is a token short of any job's (pdq.<stage>.
// <pool>.<id>), so no pool's consumer takes it; a bucket's probe key has a
// dot, which no request id has.
const (
	probeToken = "_pdq_probe"
	probeKey   = "_pdq.probe"
)

// StoreHealth is what the doctor last saw of one stream's writes.
type StoreHealth struct {
	Stream string `json:"stream"`
	// Stores is false while a probe gets no answer although the server
	// answers about the stream: its store does not write.
	Stores bool `json:"stores"`
	// Since is when it stopped storing; Error what the last probe met.
	Since time.Time `json:"since,omitzero"`
	Error string    `json:"error,omitempty"`
	// Rebuilt counts the rebuilds the doctor made of it.
	Rebuilt int `json:"rebuilt,omitempty"`
}

// StoreDoctor watches pdq's file streams and rebuilds one whose store no
// longer writes. See the comment at the top of this file.
//
// Run has a goroutine of its own; each Check probes the streams from one
// goroutine per stream (note). Request handlers call NotStoring; Health
// may be called from any goroutine, any number at once.
type StoreDoctor struct {
	// Set by NewStoreDoctor, read without a lock.
	id      string // in the rebuilds it takes
	js      jetstream.JetStream
	records *dispatcher.Records
	metrics *dispatcher.Metrics
	log     *slog.Logger

	// mu guards the fields below, and the StoreHealth that health points
	// to. No JetStream call is made under it.
	mu     sync.Mutex
	health map[string]*StoreHealth
	looks  map[string]int // probes in a row that found it not storing
	// broken counts the streams not storing, for NotStoring's every
	// request. It changes under mu, with health, and is read without it:
	// an atomic, so that a request takes no lock while every stream
	// stores.
	broken atomic.Int32
}

// NewStoreDoctor returns a doctor for the streams js reaches; records
// tells it which jobs are still live.
func NewStoreDoctor(js jetstream.JetStream, records *dispatcher.Records, metrics *dispatcher.Metrics, log *slog.Logger) *StoreDoctor {
	d := &StoreDoctor{id: dispatcher.Token(), js: js, records: records, metrics: metrics, log: log,
		health: make(map[string]*StoreHealth), looks: make(map[string]int)}
	for _, t := range storeTargets() {
		d.health[t.stream] = &StoreHealth{Stream: t.stream, Stores: true}
		metrics.StoreWritable(t.stream, true)
	}
	return d
}

// Run probes the streams every doctorEvery until ctx ends.
func (d *StoreDoctor) Run(ctx context.Context) {
	t := time.NewTicker(doctorEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.Check(ctx)
	}
}

// Health is what the doctor last saw of each stream, in a fixed order.
func (d *StoreDoctor) Health() []StoreHealth {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []StoreHealth
	for _, t := range storeTargets() {
		out = append(out, *d.health[t.stream])
	}
	return out
}

// NotStoring names the first stream that does not store, if any.
func (d *StoreDoctor) NotStoring() (StoreHealth, bool) {
	if d.broken.Load() == 0 {
		return StoreHealth{}, false
	}
	for _, h := range d.Health() {
		if !h.Stores {
			return h, true
		}
	}
	return StoreHealth{}, false
}

// Check probes every stream once, and rebuilds those that have not stored
// for brokenLooks probes when the store can write again.
func (d *StoreDoctor) Check(ctx context.Context) {
	var wg sync.WaitGroup
	for _, t := range storeTargets() {
		wg.Go(func() {
			stores, err := ProbeStore(ctx, d.js, t.stream, t.probe)
			if ctx.Err() != nil {
				return
			}
			d.note(t.stream, stores, err)
		})
	}
	wg.Wait()
	for _, t := range storeTargets() {
		d.mu.Lock()
		due := d.looks[t.stream] >= brokenLooks
		d.mu.Unlock()
		if !due {
			continue
		}
		if err := d.canWrite(ctx); err != nil {
			d.log.Debug("the store cannot write yet; no rebuild", "stream", t.stream, logging.Err(err))
			continue
		}
		unlock, ok := d.lock(ctx, t.stream)
		if !ok {
			continue // another gateway rebuilds it
		}
		err := d.rebuild(ctx, t)
		unlock()
		if err != nil {
			d.log.Error("could not rebuild a stream whose store does not write", "stream", t.stream, logging.Err(err))
			continue
		}
		d.note(t.stream, true, nil)
		d.mu.Lock()
		d.health[t.stream].Rebuilt++
		d.mu.Unlock()
	}
}

func (d *StoreDoctor) note(stream string, stores bool, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	h := d.health[stream]
	switch {
	case stores:
		if !h.Stores {
			d.broken.Add(-1)
			d.log.Info("a stream stores again", "stream", stream, "after", time.Since(h.Since).Round(time.Millisecond).String())
		}
		h.Stores, h.Since, h.Error = true, time.Time{}, ""
		d.looks[stream] = 0
	case err != nil && errors.Is(err, dispatcher.ErrNotStoring):
		d.looks[stream]++
		if h.Stores {
			d.broken.Add(1)
			h.Since = time.Now()
			d.log.Error("a stream does not store: the server answers, but not its writes (its disk may be full)", "stream", stream, logging.Err(err))
		}
		h.Stores, h.Error = false, err.Error()
	default:
		// NATS down, or slow: not the store's fault, and not known.
		d.looks[stream] = 0
		return
	}
	d.metrics.StoreWritable(stream, h.Stores)
}

// CheckStores probes each of pdq's file streams once, for pdq status: a
// stream the server could not be asked about counts as storing, with the
// error said.
func CheckStores(ctx context.Context, js jetstream.JetStream) []StoreHealth {
	targets := storeTargets()
	out := make([]StoreHealth, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() {
			stores, err := ProbeStore(ctx, js, t.stream, t.probe)
			out[i] = StoreHealth{Stream: t.stream, Stores: stores || !errors.Is(err, dispatcher.ErrNotStoring)}
			if err != nil {
				out[i].Error = err.Error()
			}
		})
	}
	wg.Wait()
	return out
}

// ProbeStore stores a probe on subject, in stream, and removes it. It
// reports whether the stream stored it; ErrNotStoring when the server
// answered about the stream but not the write; another error when the
// server could not be asked.
func ProbeStore(ctx context.Context, js jetstream.JetStream, stream, subject string) (bool, error) {
	pctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	msg := nats.NewMsg(subject)
	bucket := strings.HasPrefix(subject, "$KV.")
	if bucket {
		// A bucket denies deletes: its probe is a delete marker, which
		// every reader of the bucket takes for no key, and which the next
		// probe replaces (one value a key).
		msg.Header.Set(dispatcher.KVOperation, "DEL")
	}
	ack, err := js.PublishMsg(pctx, msg, jetstream.WithExpectStream(stream), jetstream.WithRetryAttempts(0))
	if err == nil {
		if !bucket {
			ictx, icancel := context.WithTimeout(ctx, probeWait)
			defer icancel()
			if st, err := js.Stream(ictx, stream); err == nil {
				st.DeleteMsg(ictx, ack.Sequence) // a leftover is a few bytes, gone with the stream's MaxAge
			}
		}
		return true, nil
	}
	if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, nats.ErrNoResponders) {
		// The server answered the write with an error (a limit): it
		// stores, and says why not this time.
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) {
			return true, nil
		}
		return false, err
	}
	ictx, icancel := context.WithTimeout(ctx, probeWait)
	defer icancel()
	if _, ierr := js.Stream(ictx, stream); ierr != nil {
		return false, fmt.Errorf("no answer to a write, nor about the stream: %w", ierr)
	}
	return false, fmt.Errorf("%w (%v)", dispatcher.ErrNotStoring, err)
}

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
			if floor, ok := acked[jobFilter(m.Subject)]; !ok || seq > floor {
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
			if floor, ok := acked[jobFilter(m.Subject)]; ok && seq <= floor {
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

// jobFilter is the consumer filter a job's subject falls under:
// pdq.<stage>.<pool>.> for pdq.<stage>.<pool>.<id>.
func jobFilter(subject string) string {
	if i := strings.LastIndexByte(subject, '.'); i > 0 {
		return subject[:i] + ".>"
	}
	return subject
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
