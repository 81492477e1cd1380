package sched

import "slices"

// The scheduler's helpers: KV block admission and growth, the prefix
// cache's hits, preemption and the waiting queue's order (Schedule's
// step loop is in sched.go, the block pool in blocks.go).

func (s *Scheduler) blocksFor(tokens int) int {
	return (tokens + s.cfg.BlockSize - 1) / s.cfg.BlockSize
}

// hitBlocks is the number of r's leading blocks in the cache, capped so
// that its last prompt token is computed.
func (s *Scheduler) hitBlocks(r *Request) int {
	return min(s.pool.hits(r.Hashes), (r.PromptTokens-1)/s.cfg.BlockSize)
}

// reusable is where r's computation resumes when admitted: past its cached
// prefix on first admission (or after a preemption, past what is still
// cached of it), or where it stands if it holds blocks (a loaded Decode).
func (s *Scheduler) reusable(r *Request) int {
	if len(r.blocks) > 0 {
		return r.computed
	}
	if !s.cfg.PrefixCaching {
		return 0
	}
	return s.hitBlocks(r) * s.cfg.BlockSize
}

// admit gives a request without blocks its cached prefix and blocks up to
// tokens, or changes nothing and reports false if they are not free.
func (s *Scheduler) admit(r *Request, tokens int) bool {
	if len(r.blocks) > 0 {
		return s.grow(r, tokens)
	}
	hits := 0
	if s.cfg.PrefixCaching {
		hits = s.hitBlocks(r)
	}
	// Cached blocks on the free list count against the free blocks too.
	need := s.blocksFor(tokens) - hits
	for _, h := range r.Hashes[:hits] {
		if s.pool.cached[h].inFree {
			need++
		}
	}
	if need > s.pool.nfree {
		return false
	}
	r.blocks = s.pool.touch(r.Hashes[:hits])
	r.computed = hits * s.cfg.BlockSize
	return s.grow(r, tokens)
}

// grow gives r blocks for tokens, or reports false if too few are free.
func (s *Scheduler) grow(r *Request, tokens int) bool {
	need := s.blocksFor(tokens) - len(r.blocks)
	if need <= 0 {
		return true
	}
	bs, ok := s.pool.take(need)
	if !ok {
		return false
	}
	r.blocks = append(r.blocks, bs...)
	return true
}

// cacheComputed names r's computed full prompt blocks by their hashes.
func (s *Scheduler) cacheComputed(r *Request) {
	if !s.cfg.PrefixCaching {
		return
	}
	full := min(r.computed, r.PromptTokens) / s.cfg.BlockSize
	for i := 0; i < full && i < len(r.Hashes) && i < len(r.blocks); i++ {
		s.pool.cache(r.blocks[i], r.Hashes[i])
	}
}

// victim is the running request to preempt: the last under fcfs, the
// lowest priority (then the latest) under priority.
func (s *Scheduler) victim() *Request {
	if s.cfg.Policy == Priority {
		return slices.MaxFunc(s.running, func(a, b *Request) int {
			if a.Priority != b.Priority {
				return a.Priority - b.Priority
			}
			return int(a.seq) - int(b.seq)
		})
	}
	return s.running[len(s.running)-1]
}

// preempt frees a running request's blocks and puts it back in the queue,
// first in line under fcfs, to compute again from its prefix.
func (s *Scheduler) preempt(r *Request) {
	s.running = slices.DeleteFunc(s.running, func(x *Request) bool { return x == r })
	s.free(r)
	r.computed = 0
	r.state = waiting
	r.preemptions++
	s.stats.Preemptions++
	s.waiting = slices.Insert(s.waiting, 0, r)
}

func (s *Scheduler) free(r *Request) {
	s.pool.release(r.blocks)
	r.blocks = nil
}

func (s *Scheduler) remove(r *Request) {
	s.waiting = slices.DeleteFunc(s.waiting, func(x *Request) bool { return x == r })
}

// next is the waiting request to admit next under the policy, skipping
// those that read remote KV.
func (s *Scheduler) next() *Request {
	var best *Request
	for _, r := range s.waiting {
		if r.state != waiting {
			continue
		}
		if s.cfg.Policy == FCFS {
			return r
		}
		if best == nil || r.Priority < best.Priority || r.Priority == best.Priority && r.seq < best.seq {
			best = r
		}
	}
	return best
}
