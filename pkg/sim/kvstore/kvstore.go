package kvstore

import (
	"errors"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
)

// Errors of the KV side channel. A decode engine matches them to tell a
// request the prefill engine does not know from other transfer failures.
var (
	ErrUnknownRequest = errors.New("unrecognized request: no KV blocks held under this id (never prefilled here, already read, or expired)")
	ErrBlockMismatch  = errors.New("block ids do not match the blocks held for this request")
	ErrEngineDead     = errors.New("engine is dead")
)

// Counters are the store's counters, for the engine's stats.
type Counters struct {
	BlocksHeld, BlocksExpired, HoldsExpired atomic.Int64
}

// Store holds the KV blocks of finished prefills until a decode engine
// reads them or their lease runs out, as a vLLM prefill engine with the
// NIXL connector does.
type Store struct {
	log   *slog.Logger
	stats *Counters
	lease time.Duration

	mu    sync.Mutex
	holds map[string]*hold
	next  int   // next never-used block id
	free  []int // freed block ids, reused first
}

// hold is one prefill's blocks, named by the engine's internal request id.
type hold struct {
	ExternalID string // the X-Request-Id the prefill came with
	blocks     []int
	Digest     string
	NumTokens  int
	expires    time.Time
	timer      *time.Timer
	freed      func()
}

// New is a store whose holds last lease unless read; it counts in stats.
func New(log *slog.Logger, stats *Counters, lease time.Duration) *Store {
	return &Store{log: log, stats: stats, lease: lease, holds: make(map[string]*hold)}
}

// Hold allocates blocks for a finished prefill and holds them under id.
// freed, if not nil, is called when they are freed (read and released,
// expired, replaced or closed), with the store's lock held: it must not
// call the store.
func (s *Store) Hold(id, externalID string, numBlocks, numTokens int, digest string, freed func()) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	blocks := make([]int, numBlocks)
	for i := range blocks {
		if n := len(s.free); n > 0 {
			blocks[i], s.free = s.free[n-1], s.free[:n-1]
		} else {
			blocks[i] = s.next
			s.next++
		}
	}
	h := &hold{ExternalID: externalID, blocks: blocks, Digest: digest, NumTokens: numTokens, expires: time.Now().Add(s.lease), freed: freed}
	h.timer = time.AfterFunc(s.lease, func() { s.expire(id, h) })
	if old, ok := s.holds[id]; ok {
		// An id reused while its blocks are still held: vLLM would corrupt
		// its bookkeeping; we free the old blocks and say so.
		s.log.Warn("request id reused while its KV blocks are held; releasing the old blocks", logging.KeyRequestID, id)
		s.dropLocked(id, old)
	}
	s.holds[id] = h
	s.stats.BlocksHeld.Add(int64(numBlocks))
	return slices.Clone(blocks)
}

// Read checks a decode engine's read of id's blocks and returns what they
// hold. The blocks stay held until release.
func (s *Store) Read(id string, blockIDs []int) (hold, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	h, ok := s.holds[id]
	if !ok {
		return hold{}, ErrUnknownRequest
	}
	if !slices.Equal(h.blocks, blockIDs) {
		return hold{}, ErrBlockMismatch
	}
	return hold{ExternalID: h.ExternalID, Digest: h.Digest, NumTokens: h.NumTokens, blocks: slices.Clone(h.blocks)}, nil
}

// Release frees id's blocks on a decode engine's notification. It reports
// false for an id it does not hold.
func (s *Store) Release(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	h, ok := s.holds[id]
	if !ok {
		return false
	}
	s.dropLocked(id, h)
	return true
}

// Extend renews id's lease, as vLLM's decode heartbeats do for a request
// that waits in the decode engine's queue.
func (s *Store) Extend(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	h, ok := s.holds[id]
	if !ok {
		return false
	}
	if until := time.Now().Add(s.lease); until.After(h.expires) {
		h.expires = until
		h.timer.Reset(s.lease)
	}
	return true
}

func (s *Store) expire(id string, h *hold) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.holds[id] != h {
		return // released, or replaced by a newer hold under the same id
	}
	if d := time.Until(h.expires); d > 0 {
		h.timer.Reset(d) // extended after the timer fired
		return
	}
	s.dropLocked(id, h)
	s.stats.BlocksExpired.Add(int64(len(h.blocks)))
	s.stats.HoldsExpired.Add(1)
	s.log.Warn("Releasing expired KV blocks: no decode engine read them within the lease",
		logging.KeyRequestID, id, "blocks", len(h.blocks), "lease", s.lease.String())
}

func (s *Store) dropLocked(id string, h *hold) {
	h.timer.Stop()
	delete(s.holds, id)
	s.free = append(s.free, h.blocks...)
	s.stats.BlocksHeld.Add(-int64(len(h.blocks)))
	if h.freed != nil {
		h.freed()
	}
}

// Close stops the lease timers; held blocks are dropped with the engine.
func (s *Store) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, h := range s.holds {
		s.dropLocked(id, h)
	}
}
