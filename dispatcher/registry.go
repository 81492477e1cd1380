package dispatcher

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"

	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/pkg/logging"
)

// Registry timing: workers put their entry every HeartbeatInterval; an
// entry older than LiveFor is a dead worker's.
const (
	HeartbeatInterval = 2 * time.Second
	LiveFor           = 3 * HeartbeatInterval
)

// WorkerInfo is a worker's entry in the pdq_workers bucket.
type WorkerInfo struct {
	ID       string `json:"id"`
	Role     Stage  `json:"role"`
	Pool     string `json:"pool"`
	Model    string `json:"model"`
	Engine   string `json:"engine"`
	Slots    int    `json:"slots"`
	InFlight int    `json:"in_flight"`
	// KVReleased counts the handoffs whose KV this worker released, and
	// DeadLettersRefused the failures a full DLQ refused, since it started.
	KVReleased         int64 `json:"kv_released,omitempty"`
	DeadLettersRefused int64 `json:"dead_letters_refused,omitempty"`
	// AvgJobMs is how long this worker's jobs have taken of late (an
	// exponential average), for the prefill stage's decode gate.
	AvgJobMs float64 `json:"avg_job_ms,omitempty"`
	// Breaker is the state of the worker's circuit breaker on its engine:
	// closed (healthy), open (the engine keeps failing; the worker probes
	// it and pulls nothing) or half-open (one trial job).
	Breaker BreakerState `json:"breaker,omitempty"`
	Started time.Time    `json:"started"`
}

// BreakerState is the state of a worker's circuit breaker.
type BreakerState string

// The breaker states.
const (
	BreakerClosed   BreakerState = "closed"
	BreakerOpen     BreakerState = "open"
	BreakerHalfOpen BreakerState = "half-open"
)

// Healthy reports whether the worker's engine is taking jobs.
func (w WorkerInfo) Healthy() bool { return w.Breaker != BreakerOpen }

// NewWorkerID returns a unique worker id, usable as a bucket key.
func NewWorkerID(role Stage) string { return string(role) + "-" + randomID() }

// heartbeat keeps the loop's registry entry fresh until ctx ends, then
// deletes it so gateways stop counting the worker at once.
func (l *StageLoop) heartbeat(ctx context.Context) {
	info := l.cfg.Worker
	if info.ID == "" {
		return
	}
	kv, err := l.js.KeyValue(ctx, BucketWorkers)
	if err != nil {
		l.log.Error("no worker registry; gateways will not see this worker", logging.Err(err))
		return
	}
	put := func() {
		info.InFlight = l.InFlight()
		info.KVReleased, info.DeadLettersRefused = l.Released(), l.dlqRefused.Load()
		info.AvgJobMs = l.avgJobMs()
		if l.cfg.Health != nil {
			info.Breaker = l.cfg.Health()
		}
		data, err := json.Marshal(info)
		if err != nil {
			l.log.Error("encode registry entry", logging.Err(err))
			return
		}
		pctx, cancel := context.WithTimeout(ctx, HeartbeatInterval)
		defer cancel()
		if _, err := kv.Put(pctx, info.ID, data); err != nil && ctx.Err() == nil {
			l.log.Warn("registry heartbeat failed", logging.Err(err))
		}
	}
	put()
	t := time.NewTicker(HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			put()
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			if err := kv.Delete(dctx, info.ID); err != nil {
				l.log.Warn("could not remove this worker from the registry; it expires on its own", logging.Err(err))
			}
			return
		}
	}
}

// Registry is a gateway's view of the live workers, kept current by a
// watch on the pdq_workers bucket.
type Registry struct {
	log *slog.Logger

	mu      sync.Mutex
	workers map[string]registryEntry
	models  map[string]bool // every model seen, live or not
	synced  chan struct{}
}

type registryEntry struct {
	info WorkerInfo
	at   time.Time // when the server stored the entry
}

// WatchWorkers starts watching the registry; the watch ends with ctx.
func WatchWorkers(ctx context.Context, js jetstream.JetStream, log *slog.Logger) (*Registry, error) {
	kv, err := js.KeyValue(ctx, BucketWorkers)
	if err != nil {
		return nil, fmt.Errorf("open worker registry: %w", err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return nil, fmt.Errorf("watch worker registry: %w", err)
	}
	r := &Registry{log: log, workers: make(map[string]registryEntry), models: make(map[string]bool), synced: make(chan struct{})}
	go r.run(ctx, w)
	return r, nil
}

func (r *Registry) run(ctx context.Context, w jetstream.KeyWatcher) {
	defer w.Stop()
	synced := false
	for {
		var e jetstream.KeyValueEntry
		var ok bool
		select {
		case <-ctx.Done():
			return
		case e, ok = <-w.Updates():
			if !ok {
				return
			}
		}
		if e == nil { // the initial values have all been delivered
			if !synced {
				synced = true
				close(r.synced)
			}
			continue
		}
		r.apply(e)
	}
}

func (r *Registry) apply(e jetstream.KeyValueEntry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e.Operation() != jetstream.KeyValuePut {
		delete(r.workers, e.Key())
		return
	}
	var info WorkerInfo
	if err := json.Unmarshal(e.Value(), &info); err != nil {
		r.log.Warn("ignoring an unreadable registry entry", "key", e.Key(), logging.Err(err))
		return
	}
	r.workers[e.Key()] = registryEntry{info: info, at: e.Created()}
	r.models[info.Model] = true
}

// WaitSynced waits until the registry holds the bucket's current entries.
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
}

// Status reports the live workers of model.
func (r *Registry) Status(model string) PoolStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := PoolStatus{Known: r.models[model]}
	now := time.Now()
	for _, e := range r.workers {
		if e.info.Model != model || now.Sub(e.at) > LiveFor {
			continue
		}
		switch e.info.Role {
		case StagePrefill:
			s.Prefill++
			if e.info.Healthy() {
				s.PrefillHealthy++
			}
		case StageDecode:
			s.Decode++
		}
	}
	return s
}

// Models lists the models with at least one live decode worker.
func (r *Registry) Models() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	var out []string
	for _, e := range r.workers {
		if e.info.Role == StageDecode && now.Sub(e.at) <= LiveFor && !slices.Contains(out, e.info.Model) {
			out = append(out, e.info.Model)
		}
	}
	slices.Sort(out)
	return out
}

// DecodeCapacity sums the slots of pool's live decode workers, and
// averages how long their jobs take (weighted by slots; 0 when no worker
// has finished one yet).
func (r *Registry) DecodeCapacity(pool string) (slots int, avg time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	var weighted float64
	timed := 0
	for _, e := range r.workers {
		if e.info.Role != StageDecode || e.info.Pool != pool || now.Sub(e.at) > LiveFor {
			continue
		}
		slots += e.info.Slots
		if e.info.AvgJobMs > 0 {
			weighted += e.info.AvgJobMs * float64(e.info.Slots)
			timed += e.info.Slots
		}
	}
	if timed > 0 {
		avg = time.Duration(weighted / float64(timed) * float64(time.Millisecond))
	}
	return slots, avg
}

// Slots sums the slots of pool's live workers of stage.
func (r *Registry) Slots(stage Stage, pool string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	n := 0
	for _, e := range r.workers {
		if e.info.Role == stage && e.info.Pool == pool && now.Sub(e.at) <= LiveFor {
			n += e.info.Slots
		}
	}
	return n
}

// Workers lists the live workers.
func (r *Registry) Workers() []WorkerInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	var out []WorkerInfo
	for _, e := range r.workers {
		if now.Sub(e.at) <= LiveFor {
			out = append(out, e.info)
		}
	}
	slices.SortFunc(out, func(a, b WorkerInfo) int { return strings.Compare(a.ID, b.ID) })
	return out
}

func randomID() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}
