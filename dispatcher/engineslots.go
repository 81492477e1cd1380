package dispatcher

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
type EngineSlots struct {
	mu    sync.Mutex
	used  int
	size  int
	freed chan struct{} // closed, and replaced, whenever a slot frees
}

// NewEngineSlots returns n slots.
func NewEngineSlots(n int) *EngineSlots {
	return &EngineSlots{size: max(n, 1), freed: make(chan struct{})}
}

// acquire takes a slot, waiting for one until ctx ends.
func (e *EngineSlots) acquire(ctx context.Context) error {
	return e.wait(ctx, true)
}

// tryAcquire takes a slot if one is free.
func (e *EngineSlots) tryAcquire() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.used < e.size {
		e.used++
		return true
	}
	return false
}

// waitFree returns once a slot is free, without taking it.
func (e *EngineSlots) waitFree(ctx context.Context) error {
	return e.wait(ctx, false)
}

func (e *EngineSlots) wait(ctx context.Context, take bool) error {
	for {
		e.mu.Lock()
		if e.used < e.size {
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

// release gives a slot back.
func (e *EngineSlots) release() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.used--
	close(e.freed)
	e.freed = make(chan struct{})
}
