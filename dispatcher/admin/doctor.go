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
