package affinity

import (
	"container/list"
	"slices"
	"sync"
)

// enginesPerChunk bounds the engines remembered for one chunk: the most
// recent ones, which are the likeliest to still hold it.
const enginesPerChunk = 4

// Index remembers which engines were sent which chunks, up to a number of
// chunks, forgetting the least recently used first, as the engines' own
// caches do. It is safe for concurrent use.
type Index struct {
	// mu guards chunks, lru and their entries; max is set by NewIndex.
	mu     sync.Mutex
	max    int
	chunks map[uint64]*list.Element // of *entry
	lru    list.List                // front: most recent
}

type entry struct {
	hash    uint64
	engines []string // most recent last
}

// NewIndex remembers up to chunks chunks (at least 1).
func NewIndex(chunks int) *Index {
	return &Index{max: max(chunks, 1), chunks: make(map[uint64]*list.Element)}
}

// Matched is how many of hashes, from the first, engine was sent.
func (ix *Index) Matched(hashes []uint64, engine string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.matchedLocked(hashes, engine)
}

func (ix *Index) matchedLocked(hashes []uint64, engine string) int {
	// A walk from the start: a chunk counts only if every chunk before it
	// is held too, as a prefix cache finds only a prefix.
	for i, h := range hashes {
		el, ok := ix.chunks[h]
		if !ok || !slices.Contains(el.Value.(*entry).engines, engine) {
			return i
		}
	}
	return len(hashes)
}

// Record notes that engine was sent hashes.
func (ix *Index) Record(hashes []uint64, engine string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, h := range hashes {
		if el, ok := ix.chunks[h]; ok {
			e := el.Value.(*entry)
			e.engines = slices.DeleteFunc(e.engines, func(s string) bool { return s == engine })
			if len(e.engines) == enginesPerChunk {
				e.engines = e.engines[1:]
			}
			e.engines = append(e.engines, engine)
			ix.lru.MoveToFront(el)
			continue
		}
		ix.chunks[h] = ix.lru.PushFront(&entry{hash: h, engines: []string{engine}})
		if ix.lru.Len() > ix.max {
			old := ix.lru.Back()
			ix.lru.Remove(old)
			delete(ix.chunks, old.Value.(*entry).hash)
		}
	}
}

// Len is the number of chunks remembered.
func (ix *Index) Len() int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.lru.Len()
}
