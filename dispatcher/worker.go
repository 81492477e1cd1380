package dispatcher

import (
	"encoding/json"
	"slices"
	"time"
)

// Registry timing: workers send a heartbeat every HeartbeatInterval; a
// worker not heard for LiveFor is dead.
const (
	HeartbeatInterval = 2 * time.Second
	LiveFor           = 3 * HeartbeatInterval
)

// WorkerInfo is a worker's entry in the pdq_workers bucket.
type WorkerInfo struct {
	// ID is the registry key: one per stage loop. Worker is the worker
	// process's id, shared by the loops of the models its engine serves.
	ID     string `json:"id"`
	Worker string `json:"worker,omitempty"`
	Role   Stage  `json:"role"`
	Pool   string `json:"pool"`
	Model  string `json:"model"`
	Engine string `json:"engine"`
	Slots  int    `json:"slots"`
	// Seats is what the engine runs at once, as the worker last saw it
	// (its slots follow the engine's load), at most Slots; 0 from a worker
	// that does not say, whose Slots stand for it.
	Seats    int `json:"seats,omitempty"`
	InFlight int `json:"in_flight"`
	// KVReleased counts the handoffs whose KV this worker released, and
	// DeadLettersRefused the failures a full DLQ refused, since it started.
	KVReleased         int64 `json:"kv_released,omitempty"`
	DeadLettersRefused int64 `json:"dead_letters_refused,omitempty"`
	// AvgJobMs is how long this worker's jobs have taken of late (an
	// exponential average), for the prefill stage's decode gate.
	AvgJobMs float64 `json:"avg_job_ms,omitempty"`
	// Affinity says the worker takes the jobs that prefer its engine
	// (PDQ_AFFINITY): a gateway prefers only such engines, as no one else
	// pulls a job that prefers one whose worker does not.
	Affinity bool `json:"affinity,omitempty"`
	// Breaker is the state of the worker's circuit breaker on its engine:
	// closed (healthy), open (the engine keeps failing; the worker probes
	// it and pulls nothing) or half-open (one trial job).
	Breaker BreakerState `json:"breaker,omitempty"`
	Started time.Time    `json:"started"`
	// MaxModelLen is the engine's context length for the model, 0 when
	// unknown; Card is the engine's /v1/models entry for it, verbatim.
	MaxModelLen int             `json:"max_model_len,omitempty"`
	Card        json.RawMessage `json:"card,omitempty"`
}

// Capacity is how many jobs the worker's engine runs at once: its seats,
// or its slots from a worker that does not report seats.
func (w WorkerInfo) Capacity() int {
	if w.Seats > 0 {
		return w.Seats
	}
	return w.Slots
}

// WorkerID is the id of the worker process this entry belongs to.
func (w WorkerInfo) WorkerID() string {
	if w.Worker != "" {
		return w.Worker
	}
	return w.ID
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
func NewWorkerID(role Stage) string { return string(role) + "-" + Token() }

// AllTakePreferred says whether every one of workers takes the jobs that
// prefer its engine (Affinity), so that a job may prefer one of them: a
// worker that does not (an earlier build, PDQ_AFFINITY off) neither pulls
// an engine's jobs nor takes them over, and might idle while they wait.
func AllTakePreferred(workers []WorkerInfo) bool {
	return !slices.ContainsFunc(workers, func(w WorkerInfo) bool { return !w.Affinity })
}
