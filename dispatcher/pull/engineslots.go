package pull

import (
	"context"
	"sync"
)

// EngineSlots are the slots of one engine, shared by the stage loops of
// the models it serves (its served names and LoRA adapters). A loop pulls
// only while the engine has a free slot, and takes it as soon as the pull
// brings a job, before the job's checks: so the engine never runs more
// jobs than it has slots (KV releases included), a busy engine leaves its
// other models' jobs in the queue for other workers, and a job that waits
// (two loops pulled for the last slot) is checked after the wait.
//
// How many slots there are may change while jobs run (see SetLimit): a
// worker that watches its engine's load gives the engine no more jobs
// than it starts, so that the rest wait in the queue, where the decode
// gate sees them and any idle worker can take them.
//
// Every method may be called from any goroutine, any number at once: the
// stage loops' pull goroutines (WaitFree, TryAcquire), their job and
// release goroutines (Acquire, Release), the heartbeats (Seats) and the
// worker's load follower (Load, SetLimit).
type EngineSlots struct {
	// mu guards the fields below; max is set by NewEngineSlots and only
	// read.
	mu    sync.Mutex
	used  int
	limit int           // slots now, 1..max
	max   int           // slots at most: PDQ_ENGINE_SLOTS
	seats int           // requests the engine runs at once, as last seen: limit when not known
	freed chan struct{} // closed, and replaced, whenever a slot frees
}

// NewEngineSlots returns n slots.
func NewEngineSlots(n int) *EngineSlots {
	n = max(n, 1)
	return &EngineSlots{limit: n, max: n, seats: n, freed: make(chan struct{})}
}

// Acquire takes a slot, waiting for one until ctx ends.
func (e *EngineSlots) Acquire(ctx context.Context) error {
	return e.wait(ctx, true)
}

// TryAcquire takes a slot if one is free.
func (e *EngineSlots) TryAcquire() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.used < e.limit {
		e.used++
		return true
	}
	return false
}

// WaitFree returns once a slot is free, without taking it.
func (e *EngineSlots) WaitFree(ctx context.Context) error {
	return e.wait(ctx, false)
}

func (e *EngineSlots) wait(ctx context.Context, take bool) error {
	for {
		e.mu.Lock()
		if e.used < e.limit {
			if take {
				e.used++
			}
			e.mu.Unlock()
			return nil
		}
		freed := e.freed
		e.mu.Unlock()
		select {
		case <-freed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Release gives a slot back.
func (e *EngineSlots) Release() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.used--
	e.wake()
}

// wake tells the waiters for a slot to look again. e.mu is held.
func (e *EngineSlots) wake() {
	close(e.freed)
	e.freed = make(chan struct{})
}

// SetLimit makes n slots (kept within 1 and the slots NewEngineSlots
// made), for an engine that runs seats requests at once (0: n). Jobs that
// run beyond a lowered limit run to their end; no new job starts until
// fewer run than the limit.
func (e *EngineSlots) SetLimit(n, seats int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	n = min(max(n, 1), e.max)
	if seats <= 0 || seats > n {
		seats = n
	}
	if n > e.limit {
		e.wake()
	}
	e.limit, e.seats = n, seats
}

// Load is how many slots are taken, how many there are now, and how many
// there are at most.
func (e *EngineSlots) Load() (used, limit, most int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.used, e.limit, e.max
}

// Seats is how many requests the engine runs at once, as last seen: what
// the decode gate counts on (the slots beyond it only queue in the
// engine).
func (e *EngineSlots) Seats() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.seats
}

// InUse is how many of the slots are taken now.
func (e *EngineSlots) InUse() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.used
}
