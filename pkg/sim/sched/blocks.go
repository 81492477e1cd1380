package sched

// block is one KV cache block.
type block struct {
	id   int
	refs int
	// hash names the prompt block whose KV it holds, once computed; 0 is
	// none. A free block keeps its hash until it is taken for new tokens.
	hash uint64
	// prev and next link the free list; inFree says the block is on it.
	prev, next *block
	inFree     bool
}

// pool is the engine's KV blocks: a free list in LRU order (evicted from
// the head) and the index of cached blocks by hash, as vLLM's BlockPool.
type pool struct {
	blocks []block
	// head and tail of the free list; a sentinel keeps the links simple.
	free   block
	nfree  int
	cached map[uint64]*block
}

func newPool(n int) *pool {
	p := &pool{blocks: make([]block, n), cached: make(map[uint64]*block)}
	p.free.next, p.free.prev = &p.free, &p.free
	for i := range p.blocks {
		p.blocks[i].id = i
		p.pushFree(&p.blocks[i])
	}
	return p
}

func (p *pool) pushFree(b *block) {
	b.prev, b.next = p.free.prev, &p.free
	p.free.prev.next = b
	p.free.prev = b
	b.inFree = true
	p.nfree++
}

func (p *pool) removeFree(b *block) {
	b.prev.next, b.next.prev = b.next, b.prev
	b.prev, b.next, b.inFree = nil, nil, false
	p.nfree--
}

// hits is how many of hashes, from the first, name cached blocks.
func (p *pool) hits(hashes []uint64) int {
	for i, h := range hashes {
		if _, ok := p.cached[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// touch takes a reference on the cached blocks of hashes[:n], taking free
// ones off the free list. The caller has checked they are cached.
func (p *pool) touch(hashes []uint64) []*block {
	out := make([]*block, len(hashes))
	for i, h := range hashes {
		b := p.cached[h]
		if b.inFree {
			p.removeFree(b)
		}
		b.refs++
		out[i] = b
	}
	return out
}

// take allocates n new blocks from the head of the free list, evicting
// their cached hashes, or none if fewer than n are free.
func (p *pool) take(n int) ([]*block, bool) {
	if n > p.nfree {
		return nil, false
	}
	out := make([]*block, n)
	for i := range out {
		b := p.free.next
		p.removeFree(b)
		if b.hash != 0 {
			if p.cached[b.hash] == b {
				delete(p.cached, b.hash)
			}
			b.hash = 0
		}
		b.refs = 1
		out[i] = b
	}
	return out, true
}

// release drops a reference on each block, last block first, so that a
// request's prefix goes to the free list after its tail and is evicted
// after it.
func (p *pool) release(bs []*block) {
	for i := len(bs) - 1; i >= 0; i-- {
		b := bs[i]
		b.refs--
		if b.refs == 0 {
			p.pushFree(b)
		}
	}
}

// cache names a computed full block by its hash, unless another block
// already holds that hash (then both hold the same KV, and the index keeps
// the first, as vLLM does).
func (p *pool) cache(b *block, h uint64) {
	if b.hash != 0 {
		return
	}
	if _, ok := p.cached[h]; ok {
		return
	}
	b.hash = h
	p.cached[h] = b
}

// used is the number of blocks not free (held by a request).
func (p *pool) used() int { return len(p.blocks) - p.nfree }
