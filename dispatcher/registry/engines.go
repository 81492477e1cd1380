package registry

import (
	"slices"
	"strings"

	"github.com/pdq-dev/pdq/dispatcher"
)

// Engines lists the live workers of stage and pool whose engines take jobs
// (breaker not open), one per engine, in engine order: where a job of the
// pool may be placed.
func (r *Registry) Engines(stage dispatcher.Stage, pool string) []dispatcher.WorkerInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var out []dispatcher.WorkerInfo
	for _, e := range r.workers {
		if e.info.Role != stage || e.info.Pool != pool || !e.info.Healthy() || !r.live(e.at, now) {
			continue
		}
		if i := slices.IndexFunc(out, func(w dispatcher.WorkerInfo) bool { return w.Engine == e.info.Engine }); i >= 0 {
			continue // two loops of one engine in one pool: one place
		}
		out = append(out, e.info)
	}
	slices.SortFunc(out, func(a, b dispatcher.WorkerInfo) int { return strings.Compare(a.Engine, b.Engine) })
	return out
}

// AnyAffinity says whether a live worker of stage and pool, its engine
// healthy or not, takes the jobs that prefer its engine (PDQ_AFFINITY):
// then such jobs wait in the engines' consumers, and count as the pool's
// backlog, also while those engines' breakers are open.
func (r *Registry) AnyAffinity(stage dispatcher.Stage, pool string) bool {
	return r.sumLive(stage, pool, func(w dispatcher.WorkerInfo) int {
		if w.Affinity {
			return 1
		}
		return 0
	}) > 0
}

// MostSlots sums the slots of pool's live workers of stage: the most jobs
// they take at once (PDQ_ENGINE_SLOTS), whatever their engines run now.
// What a gateway lets in must not be bounded by Slots (their engines'
// seats as seen so far) alone: the workers learn more seats only from
// jobs beyond those (the fair queue lets in up to twice SeatsSeen).
func (r *Registry) MostSlots(stage dispatcher.Stage, pool string) int {
	return r.sumLive(stage, pool, func(w dispatcher.WorkerInfo) int { return w.Slots })
}
