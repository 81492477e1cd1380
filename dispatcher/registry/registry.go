package registry

import (
	"bytes"
	"context"
	"encoding/json"

	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// Registry is a view of the live workers, kept on this process's own
// clock: a worker is live while its heartbeats arrive here, whatever the
// NATS server's clock says. Heartbeats travel on core NATS
// (WorkerSubject), whose subscriptions survive reconnects and server
// restarts; the pdq_workers bucket is only read once, at start, to learn
// which workers to wait for.
//
// onBeat runs on the heartbeat subscription's goroutine; run (the sync
// timer, pruning, the connection's changes) on a goroutine of its own.
// WaitSynced and the queries (Status, Cards, Decoders, DecodeCapacity,
// Slots, Workers) may be called from any goroutine, any number at once:
// request handlers, decode gates and workers call them.
type Registry struct {
	// Set by watchWorkers (now is a test's clock), read without a lock.
	log *slog.Logger
	now func() time.Time
	// synced is made by watchWorkers and closed by markSynced, under mu;
	// WaitSynced waits on it without the lock.
	synced chan struct{}

	// mu guards the fields below.
	mu      sync.Mutex
	workers map[string]registryEntry
	models  map[string]bool // every model seen, live or not
	// expected are the workers listed in the bucket at start, not yet
	// heard; filled before the subscription, nil once synced.
	expected map[string]bool
	isSynced bool
	// The last time this process's connection dropped, and came back:
	// silence while it was cut off from NATS says nothing of the workers.
	down, up  time.Time
	connected bool
}

type registryEntry struct {
	info dispatcher.WorkerInfo
	at   time.Time // when this process last heard the worker, on its clock
	raw  []byte    // the heartbeat info came from
}

// syncWait bounds how long WaitSynced waits for workers that the bucket
// lists but that do not answer (crashed within the bucket's TTL).
const syncWait = dispatcher.HeartbeatInterval

// pruneAfter is how long a silent worker stays in memory (as dead).
const pruneAfter = 10 * time.Minute

// WatchWorkers starts listening to the workers' heartbeats and asks every
// worker to send one at once; the watch ends with ctx.
func WatchWorkers(ctx context.Context, js jetstream.JetStream, log *slog.Logger) (*Registry, error) {
	return watchWorkers(ctx, js, log, time.Now)
}

func watchWorkers(ctx context.Context, js jetstream.JetStream, log *slog.Logger, now func() time.Time) (*Registry, error) {
	nc := js.Conn()
	r := &Registry{log: log, now: now, workers: make(map[string]registryEntry), models: make(map[string]bool),
		expected: make(map[string]bool), synced: make(chan struct{}), connected: nc.IsConnected()}
	// The workers the bucket lists are the ones to wait for before the
	// view counts as complete. A missing bucket (a NATS restart lost it)
	// lists none; syncWait then covers the workers' first answers.
	lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	listed, lerr := listWorkers(lctx, js)
	cancel()
	for _, id := range listed {
		r.expected[id] = true
	}
	status := nc.StatusChanged(nats.CONNECTED, nats.DISCONNECTED, nats.RECONNECTING)
	sub, err := nc.Subscribe(dispatcher.WorkerSubject("*"), r.onBeat)
	if err != nil {
		nc.RemoveStatusListener(status)
		return nil, fmt.Errorf("listen to worker heartbeats: %w", err)
	}
	if err := nc.Publish(dispatcher.WorkersAskSubject, nil); err != nil {
		log.Warn("could not ask the workers for a heartbeat; waiting for their next one", logging.Err(err))
	}
	r.mu.Lock()
	switch {
	case lerr != nil:
		log.Debug("worker registry bucket not readable; learning workers from their heartbeats", logging.Err(lerr))
	case len(r.expected) == 0:
		r.markSynced()
	}
	r.mu.Unlock()
	go r.run(ctx, nc, sub, status)
	return r, nil
}

// listWorkers lists the ids in the pdq_workers bucket.
func listWorkers(ctx context.Context, js jetstream.KeyValueManager) ([]string, error) {
	kv, err := js.KeyValue(ctx, dispatcher.BucketWorkers)
	if err != nil {
		return nil, err
	}
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		return nil, err
	}
	defer lister.Stop()
	var ids []string
	for id := range lister.Keys() {
		ids = append(ids, id)
	}
	return ids, nil
}

func (r *Registry) run(ctx context.Context, nc *nats.Conn, sub *nats.Subscription, status chan nats.Status) {
	defer nc.RemoveStatusListener(status)
	defer sub.Unsubscribe()
	syncTimer := time.NewTimer(syncWait)
	defer syncTimer.Stop()
	prune := time.NewTicker(time.Minute)
	defer prune.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-syncTimer.C:
			r.mu.Lock()
			if !r.isSynced && len(r.expected) > 0 {
				r.log.Debug("workers listed in the registry bucket did not answer; counting them gone", "workers", len(r.expected))
			}
			r.markSynced()
			r.mu.Unlock()
		case <-prune.C:
			r.prune()
		case s := <-status:
			r.connectionChanged(s)
			if s == nats.CONNECTED {
				// Workers that reconnected before this process missed
				// nothing, but their next beat may be 2 s away: ask now.
				if err := nc.Publish(dispatcher.WorkersAskSubject, nil); err != nil {
					r.log.Debug("could not ask the workers for a heartbeat", logging.Err(err))
				}
			}
		}
	}
}

// markSynced ends WaitSynced; r.mu is held.
func (r *Registry) markSynced() {
	if !r.isSynced {
		r.isSynced = true
		r.expected = nil
		close(r.synced)
	}
}

func (r *Registry) connectionChanged(s nats.Status) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	switch {
	case s == nats.CONNECTED && !r.connected:
		r.connected, r.up = true, now
	case s != nats.CONNECTED && r.connected:
		r.connected, r.down = false, now
	}
}

// onBeat takes a heartbeat or a leaving message, stamped with the time
// this process received it.
func (r *Registry) onBeat(m *nats.Msg) {
	id := m.Subject[len(dispatcher.WorkerSubject("")):]
	if id == "" || m.Subject == dispatcher.WorkersAskSubject {
		return
	}
	at := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.expected != nil {
		delete(r.expected, id)
		if len(r.expected) == 0 {
			r.markSynced()
		}
	}
	if m.Header.Get(dispatcher.HeaderLeaving) != "" {
		delete(r.workers, id)
		return
	}
	if e, ok := r.workers[id]; ok && bytes.Equal(e.raw, m.Data) {
		// The beat of a worker whose entry did not change (an idle one's):
		// every registry hears every worker, so a fleet of N idle workers
		// would decode some N² entries every heartbeat interval.
		e.at = at
		r.workers[id] = e
		return
	}
	var info dispatcher.WorkerInfo
	if err := json.Unmarshal(m.Data, &info); err != nil || info.ID != id {
		r.log.Warn("ignoring an unreadable worker heartbeat", "subject", m.Subject, logging.Err(err))
		return
	}
	r.workers[id] = registryEntry{info: info, at: at, raw: m.Data}
	r.models[info.Model] = true
}

func (r *Registry) prune() {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for id, e := range r.workers {
		if !r.live(e.at, now) && now.Sub(e.at) > pruneAfter {
			delete(r.workers, id)
		}
	}
}

// live reports whether a worker last heard at is live at now: heard within
// LiveFor. Silence while this process was cut off from NATS is no evidence
// that a worker died, so a worker heard before the connection last dropped
// keeps the time it had left then, counted on from the reconnect. r.mu is
// held.
func (r *Registry) live(at, now time.Time) bool {
	if now.Sub(at) <= dispatcher.LiveFor {
		return true
	}
	if at.After(r.down) {
		return false
	}
	silence := r.down.Sub(at)
	if r.connected {
		silence += now.Sub(r.up)
	}
	return silence <= dispatcher.LiveFor
}

// WaitSynced waits until every worker listed in the pdq_workers bucket has
// been heard, or syncWait has passed: a gateway that serves before then
// would refuse requests for pools whose workers it has not heard yet.
func (r *Registry) WaitSynced(ctx context.Context) error {
	select {
	case <-r.synced:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// PoolStatus counts a model's live workers by stage.
type PoolStatus struct {
	Known   bool // a worker for the model has been seen since the gateway started
	Prefill int
	Decode  int
	// PrefillHealthy counts the live prefill workers whose breaker is not
	// open: the ones a prefill job can expect to run on.
	PrefillHealthy int
	// MaxModelLen is the smallest context length the live decode workers
	// report, 0 when none does: the longest request every decode engine
	// of the model accepts.
	MaxModelLen int
}

// Status reports the live workers of model.
func (r *Registry) Status(model string) PoolStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := PoolStatus{Known: r.models[model]}
	now := r.now()
	for _, e := range r.workers {
		if e.info.Model != model || !r.live(e.at, now) {
			continue
		}
		switch e.info.Role {
		case dispatcher.StagePrefill:
			s.Prefill++
			if e.info.Healthy() {
				s.PrefillHealthy++
			}
		case dispatcher.StageDecode:
			s.Decode++
			if n := e.info.MaxModelLen; n > 0 && (s.MaxModelLen == 0 || n < s.MaxModelLen) {
				s.MaxModelLen = n
			}
		}
	}
	return s
}

// Cards returns, for each model with a live decode worker, the engine's
// /v1/models entry (nil when the worker sent none): the card of the
// worker whose entry id sorts first, so that the answer does not change
// from one call to the next.
func (r *Registry) Cards() map[string]json.RawMessage {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	out := make(map[string]json.RawMessage)
	from := make(map[string]string) // model → the entry id its card is from
	for _, e := range r.workers {
		if e.info.Role != dispatcher.StageDecode || !r.live(e.at, now) {
			continue
		}
		if id, ok := from[e.info.Model]; !ok || e.info.ID < id {
			out[e.info.Model], from[e.info.Model] = e.info.Card, e.info.ID
		}
	}
	return out
}

// Decoders lists the live decode workers of model whose engines take
// jobs (breaker not open).
func (r *Registry) Decoders(model string) []dispatcher.WorkerInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var out []dispatcher.WorkerInfo
	for _, e := range r.workers {
		if e.info.Role == dispatcher.StageDecode && e.info.Model == model && e.info.Healthy() && r.live(e.at, now) {
			out = append(out, e.info)
		}
	}
	return out
}

// DecodeCapacity sums the capacity (seats) of pool's live decode workers,
// and averages how long their jobs take (weighted by seats; 0 when no
// worker has reported one yet).
func (r *Registry) DecodeCapacity(pool string) (slots int, avg time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var weighted float64
	timed := 0
	for _, e := range r.workers {
		if e.info.Role != dispatcher.StageDecode || e.info.Pool != pool || !r.live(e.at, now) {
			continue
		}
		c := e.info.Capacity()
		slots += c
		if e.info.AvgJobMs > 0 {
			weighted += e.info.AvgJobMs * float64(c)
			timed += c
		}
	}
	if timed > 0 {
		avg = time.Duration(weighted / float64(timed) * float64(time.Millisecond))
	}
	return slots, avg
}

// Slots sums the capacity (seats) of pool's live workers of stage.
func (r *Registry) Slots(stage dispatcher.Stage, pool string) int {
	return r.sumLive(stage, pool, dispatcher.WorkerInfo.Capacity)
}

// SeatsSeen sums the seats pool's live workers of stage have seen their
// engines run, counting one for a worker that has not said (see
// WorkerInfo.Seats): what the pool is known to run at once, where Slots
// would count a new worker's PDQ_ENGINE_SLOTS.
func (r *Registry) SeatsSeen(stage dispatcher.Stage, pool string) int {
	return r.sumLive(stage, pool, func(w dispatcher.WorkerInfo) int { return max(w.Seats, 1) })
}

// sumLive sums f over pool's live workers of stage.
func (r *Registry) sumLive(stage dispatcher.Stage, pool string, f func(dispatcher.WorkerInfo) int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	n := 0
	for _, e := range r.workers {
		if e.info.Role == stage && e.info.Pool == pool && r.live(e.at, now) {
			n += f(e.info)
		}
	}
	return n
}

// Workers lists the live workers.
func (r *Registry) Workers() []dispatcher.WorkerInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var out []dispatcher.WorkerInfo
	for _, e := range r.workers {
		if r.live(e.at, now) {
			out = append(out, e.info)
		}
	}
	slices.SortFunc(out, func(a, b dispatcher.WorkerInfo) int { return strings.Compare(a.ID, b.ID) })
	return out
}
