package affinity

import (
	"slices"
	"sync"

	"github.com/pdq-dev/pdq/dispatcher"
)

// placementIndexChunks bounds the prefix index: 64k chunks of 256 bytes
// stand for 16 MiB of prompt text, more than a pool's prefix caches hold
// of distinct prefixes at the seed profile's 262k tokens an engine.
const placementIndexChunks = 1 << 16

// Placer picks the engine of one stage each job should go to first: the
// one whose prefix cache likely holds the most of its prompt, weighed
// against how busy each engine is (see Choose). An engine's load is the
// requests this Placer placed there that it has not finished with (their
// prefill, or their decode), beyond the least loaded engine's: known at
// once, unlike the workers' heartbeats. A gateway keeps one a stage.
//
// Place, PlaceLearning, Cached, and the functions they return, are called
// from any number of request goroutines at once.
type Placer struct {
	// index is set by NewPlacer and has a lock of its own; Place records
	// in it with mu held, so that its choice and its count go together
	// (a learn records without: it counts nothing).
	index *Index
	// balance, when not 0, caps the slots an engine's load is a share of
	// (see NewDecodePlacer).
	balance int
	// mu guards busy.
	mu   sync.Mutex
	busy map[string]int // engine key → requests placed there that it has not finished with
}

// NewPlacer makes a gateway's Placer of prefill engines.
func NewPlacer() *Placer {
	return &Placer{index: NewIndex(placementIndexChunks), busy: make(map[string]int)}
}

// decodeBalance is how many decodes more than the least loaded engine's
// outweigh a whole prompt cached. A decode engine runs all its decodes in
// each step, whose time grows with every one's context: each decode more
// on one engine slows every token of the others there, while a cached
// prefix only shortens one KV read. Its workers' slots (64 by default)
// would let an engine that holds a popular prefix run scores more than
// the others before its load counted.
const decodeBalance = 8

// NewDecodePlacer makes a gateway's Placer of decode engines: an engine's
// load counts as a share of decodeBalance slots at most.
func NewDecodePlacer() *Placer {
	p := NewPlacer()
	p.balance = decodeBalance
	return p
}

// Place returns the key of the engine a job should prefer among workers
// (one per engine), and counts the job there; "" when there is nothing to
// choose between. prompt gives the prompt's chunk hashes; it is called
// only then, as hashing reads the prompt's text. sent is to be called
// once the job went out, for the index to remember the prompt there (a
// job that was not sent leaves no trace of a prompt the engine never
// saw); done when the engine is free of it (its stage ended), or the
// request ends (whichever comes first counts).
func (p *Placer) Place(prompt func() []uint64, all []dispatcher.WorkerInfo) (engine string, sent, done func()) {
	engine, sent, done, _ = p.place(prompt, all, false)
	return engine, sent, done
}

// PlaceLearning is Place for a job whose gateway hears which engine ran
// it (a prefill's end names its engine, see reply.Stream.OnPrefilledOn): a
// prompt that the engine chosen for it holds none of (new to every
// engine, or whose holders are busier than their share of it is worth)
// prefers none, and goes to the first worker with a free seat, as it
// would without affinity; learn, not nil then, records the prompt at the
// engine that ran it. Placed anyway, by load alone, it would go to the
// engine this gateway thinks least busy, while the workers' pulls know
// which engine has a seat free: in the random workload at capacity the
// engines then idled between prompts on one side while prompts queued
// on another (see docs/scheduling.md).
func (p *Placer) PlaceLearning(prompt func() []uint64, all []dispatcher.WorkerInfo) (engine string, sent, done func(), learn func(engine string)) {
	return p.place(prompt, all, true)
}

func (p *Placer) place(prompt func() []uint64, all []dispatcher.WorkerInfo, learning bool) (engine string, sent, done func(), learn func(string)) {
	none := func() {}
	workers, keys := choosable(all)
	if len(workers) < 2 {
		return "", none, none, nil
	}
	hashes := prompt()
	if len(hashes) == 0 {
		return "", none, none, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, w := range workers {
		// An engine whose breaker is half-open waits for a trial job to
		// close it: it gets one whenever it has none of this gateway's,
		// or affinity might keep every job away from it for good.
		if w.Breaker == dispatcher.BreakerHalfOpen && p.busy[keys[i]] == 0 {
			engine, sent, done = p.choose(keys[i], hashes)
			return engine, sent, done, nil
		}
	}
	least := -1
	for _, key := range keys {
		if b := p.busy[key]; least < 0 || b < least {
			least = b
		}
	}
	engines := make([]Engine, len(workers))
	for i, w := range workers {
		slots := w.Slots
		if p.balance > 0 {
			slots = min(slots, p.balance)
		}
		engines[i] = Engine{Key: keys[i], Slots: slots, Busy: p.busy[keys[i]] - least}
	}
	c := Choose(p.index, hashes, engines)
	if learning && c.Matched == 0 {
		return "", none, none, func(engine string) {
			// Only an engine it may prefer: another's worker takes
			// no preferred jobs, and its record would only fill
			// the index.
			if slices.Contains(keys, engine) {
				p.index.Record(hashes, engine)
			}
		}
	}
	engine, sent, done = p.choose(c.Engine, hashes)
	return engine, sent, done, nil
}

// Cached is the most of the prompt's text, in bytes from its start, that
// an engine among workers was sent: what an engine's prefix cache likely
// holds of it (whole chunks of the first MaxChunks only). It is 0, without
// calling prompt, when Place would have nothing to choose between.
func (p *Placer) Cached(prompt func() []uint64, all []dispatcher.WorkerInfo) int {
	workers, keys := choosable(all)
	if len(workers) < 2 {
		return 0
	}
	hashes := prompt()
	best := 0
	for _, key := range keys {
		best = max(best, p.index.Matched(hashes, key))
	}
	return best * ChunkBytes
}

// choosable are the engines of all that a job may prefer, with their keys:
// those whose workers take the jobs that prefer them (a worker of another
// build, or with PDQ_AFFINITY off, does not).
func choosable(all []dispatcher.WorkerInfo) (workers []dispatcher.WorkerInfo, keys []string) {
	for _, w := range all {
		if w.Affinity {
			workers = append(workers, w)
			keys = append(keys, dispatcher.EngineKey(w.Engine))
		}
	}
	return workers, keys
}

// choose notes that a job whose prompt has hashes goes to engine, and
// returns what Place returns. p.mu is held.
func (p *Placer) choose(engine string, hashes []uint64) (string, func(), func()) {
	p.busy[engine]++
	var once sync.Once
	sent := func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.index.Record(hashes, engine)
	}
	return engine, sent, func() {
		once.Do(func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.busy[engine]--; p.busy[engine] <= 0 {
				delete(p.busy, engine)
			}
		})
	}
}
