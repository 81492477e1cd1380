package sched

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Policy orders the waiting requests, as vLLM's --scheduling-policy.
type Policy string

const (
	// FCFS admits in arrival order; a preempted request goes first.
	FCFS Policy = "fcfs"
	// Priority admits the lowest priority value first, then by arrival,
	// and preempts the highest value (then the latest) first.
	Priority Policy = "priority"
)

// Cost is what one engine step takes.
type Cost struct {
	// Base is the fixed cost of a step: launching the forward pass and
	// reading the weights, which a batch shares.
	Base time.Duration
	// PerPrefillToken is the cost of each prompt token computed.
	PerPrefillToken time.Duration
	// PerDecodeSeq is the cost of each sequence that decodes a token.
	PerDecodeSeq time.Duration
	// PerContextToken is the cost of each token of KV a decoding sequence
	// attends to: decode reads its whole context every step, so long
	// contexts make steps slower (memory bandwidth).
	PerContextToken time.Duration
}

// Step is the cost of a step with prefill prompt tokens and decode
// sequences that attend to context tokens in all.
func (c Cost) Step(prefill, decode, context int) time.Duration {
	return c.Base + time.Duration(prefill)*c.PerPrefillToken + time.Duration(decode)*c.PerDecodeSeq +
		time.Duration(context)*c.PerContextToken
}

// Config is one engine's scheduler and KV cache.
type Config struct {
	// BlockSize is the number of tokens in a KV block.
	BlockSize int
	// NumBlocks is the KV capacity in blocks (vLLM's num_gpu_blocks).
	NumBlocks int
	// MaxNumSeqs is the number of requests that run at once.
	MaxNumSeqs int
	// MaxNumBatchedTokens is the token budget of a step.
	MaxNumBatchedTokens int
	// PrefixCaching reuses cached prompt blocks (vLLM's
	// --enable-prefix-caching, on by default in V1).
	PrefixCaching bool
	// Policy orders waiting requests.
	Policy Policy
	// Cost prices a step.
	Cost Cost
}

// Validate reports every bad value at once.
func (c Config) Validate() error {
	var errs []error
	for name, v := range map[string]int{"block size": c.BlockSize, "KV blocks": c.NumBlocks,
		"max-num-seqs": c.MaxNumSeqs, "max-num-batched-tokens": c.MaxNumBatchedTokens} {
		if v < 1 {
			errs = append(errs, fmt.Errorf("%s must be at least 1, got %d", name, v))
		}
	}
	if c.Policy != FCFS && c.Policy != Priority {
		errs = append(errs, fmt.Errorf("scheduling policy must be fcfs or priority, got %q", c.Policy))
	}
	if c.Cost.Base < 0 || c.Cost.PerPrefillToken < 0 || c.Cost.PerDecodeSeq < 0 || c.Cost.PerContextToken < 0 {
		errs = append(errs, errors.New("step costs must not be negative"))
	}
	return errors.Join(errs...)
}

// Kind is the part a request plays.
type Kind int

const (
	// Local prefills and decodes here.
	Local Kind = iota
	// Prefill is a prefill for a remote decode (do_remote_decode): its
	// blocks stay held after it ends, until Release.
	Prefill
	// Decode decodes from KV read from a prefill engine
	// (do_remote_prefill): it waits in Loads until Loaded.
	Decode
)

type state int

const (
	waiting state = iota
	loading       // a Decode with its blocks, reading remote KV
	running
	held // a finished Prefill whose blocks wait for the decode
	finished
)

// Request is one engine request. The caller sets the exported fields
// before Add and does not change them after, but for MaxTokens, which may
// be lowered until the request's first token (a remote decode learns its
// answer's length when it has read its KV).
type Request struct {
	// ID names the request in errors.
	ID   string
	Kind Kind
	// PromptTokens is the prompt's length; Hashes the chained hashes of
	// its full blocks (len PromptTokens/BlockSize).
	PromptTokens int
	Hashes       []uint64
	// MaxTokens is the number of tokens to generate, at least 1.
	MaxTokens int
	// Priority orders waiting requests under the priority policy:
	// lower first.
	Priority int

	state     state
	seq       uint64
	blocks    []*block
	computed  int
	generated int
	// cached is the prompt tokens found in the local prefix cache when the
	// request was first admitted; -1 before. external is the tokens read
	// from the prefill engine.
	cached, external int
	// read is set once a Decode has been handed out to read its KV: after
	// a preemption it computes its prompt locally, as the prefill engine
	// has freed its blocks.
	read        bool
	preemptions int
}

// Generated is the number of tokens sampled so far.
func (r *Request) Generated() int { return r.generated }

// CachedTokens is the prompt tokens the request did not compute, as vLLM's
// num_cached_tokens (usage.prompt_tokens_details.cached_tokens): found in
// the local prefix cache, plus those read from a prefill engine.
func (r *Request) CachedTokens() int { return max(r.cached, 0) + r.external }

// LocalHitTokens is the prompt tokens found in the local prefix cache.
func (r *Request) LocalHitTokens() int { return max(r.cached, 0) }

// ExternalTokens is the prompt tokens a Decode reads from the prefill
// engine: the prompt less its local prefix hit.
func (r *Request) ExternalTokens() int { return r.external }

// Preemptions is how many times the request was preempted.
func (r *Request) Preemptions() int { return r.preemptions }

// Blocks is the number of KV blocks the request holds.
func (r *Request) Blocks() int { return len(r.blocks) }

// Stats are the scheduler's gauges and counters, as vLLM's metrics.
type Stats struct {
	Running, Waiting int
	// UsedBlocks of NumBlocks are held by requests (held prefills too).
	UsedBlocks, NumBlocks int
	// PrefixQueries and PrefixHits count prompt tokens looked up in the
	// prefix cache, and found.
	PrefixQueries, PrefixHits int64
	Preemptions               int64
	Steps                     int64
	// Busy is the time the engine spent in steps (their modelled cost):
	// over a run's length and engines, how much of the time engines
	// computed, what a router that leaves engines idle loses.
	Busy time.Duration
}

// KVUsage is vLLM's kv_cache_usage_perc: the share of blocks in use.
func (s Stats) KVUsage() float64 {
	if s.NumBlocks == 0 {
		return 0
	}
	return float64(s.UsedBlocks) / float64(s.NumBlocks)
}

// Scheduler is one engine's scheduler. It is not safe for concurrent use.
type Scheduler struct {
	cfg     Config
	pool    *pool
	waiting []*Request // includes loading requests, skipped until loaded
	running []*Request
	seq     uint64
	stats   Stats
}

// New builds a scheduler; cfg must be valid.
func New(cfg Config) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Scheduler{cfg: cfg, pool: newPool(cfg.NumBlocks)}, nil
}

// ErrTooLong is a request that can never fit in the KV cache.
var ErrTooLong = errors.New("the request needs more KV blocks than the engine has")

// Add queues a request.
func (s *Scheduler) Add(r *Request) error {
	if r.MaxTokens < 1 || r.PromptTokens < 1 {
		return fmt.Errorf("request %s: want at least 1 prompt and 1 output token", r.ID)
	}
	if s.blocksFor(r.PromptTokens+r.MaxTokens-1) > s.cfg.NumBlocks {
		return fmt.Errorf("request %s: %d tokens in %d-token blocks: %w (%d)", r.ID, r.PromptTokens+r.MaxTokens, s.cfg.BlockSize, ErrTooLong, s.cfg.NumBlocks)
	}
	s.seq++
	r.seq, r.state, r.cached = s.seq, waiting, -1
	s.waiting = append(s.waiting, r)
	return nil
}

// Plan is what one step runs.
type Plan struct {
	// Duration is the step's cost.
	Duration time.Duration
	// PrefillTokens and DecodeSeqs are what it computes; Context is the
	// tokens of KV the decodes attend to.
	PrefillTokens, DecodeSeqs, Context int
	// Loads are Decode requests that got their blocks in this step: read
	// their KV, then call Loaded.
	Loads []*Request
	// Preempted lost their blocks in this step and wait again.
	Preempted []*Request
	entries   []entry
}

type entry struct {
	r *Request
	n int // tokens computed in the step
}

// Empty says the step runs nothing: wait for a change before the next.
func (p *Plan) Empty() bool { return len(p.entries) == 0 }

// Event is what a step did to one request.
type Event struct {
	Req *Request
	// Token: a token was sampled, the Req.Generated()-th.
	Token bool
	// Done: the request has all its tokens. A Prefill's blocks stay held
	// until Release; others are freed.
	Done bool
}

// Schedule plans the next step and takes the KV blocks it needs.
func (s *Scheduler) Schedule() *Plan {
	p := &Plan{}
	budget := s.cfg.MaxNumBatchedTokens
	preempted := false
	scheduled := map[*Request]int{} // index into p.entries
	for i := 0; i < len(s.running) && budget > 0; i++ {
		r := s.running[i]
		n := min(r.PromptTokens+r.generated-r.computed, budget)
		if n <= 0 {
			continue
		}
		for !s.grow(r, r.computed+n) {
			victim := s.victim()
			at := slices.Index(s.running, victim)
			s.preempt(victim)
			p.Preempted = append(p.Preempted, victim)
			preempted = true
			if k, ok := scheduled[victim]; ok {
				budget += p.entries[k].n
				p.entries[k].r = nil
			}
			if victim == r {
				break
			}
			if at < i {
				i-- // the running list shifted under r
			}
		}
		if r.state != running {
			i-- // r was preempted: the next request is at i now
			continue
		}
		scheduled[r] = len(p.entries)
		p.entries = append(p.entries, entry{r: r, n: n})
		budget -= n
	}
	p.entries = slices.DeleteFunc(p.entries, func(e entry) bool { return e.r == nil })

	for !preempted && budget > 0 && len(s.running) < s.cfg.MaxNumSeqs {
		r := s.next()
		if r == nil {
			break
		}
		if r.cached < 0 {
			r.cached = 0
			if s.cfg.PrefixCaching {
				r.cached = s.hitBlocks(r) * s.cfg.BlockSize
			}
			s.stats.PrefixQueries += int64(r.PromptTokens)
			s.stats.PrefixHits += int64(r.cached)
		}
		if r.Kind == Decode && !r.read {
			// Reuse the local prefix, take blocks for the whole prompt,
			// and read the rest from the prefill engine.
			if !s.admit(r, r.PromptTokens) {
				break
			}
			r.external = r.PromptTokens - r.computed
			r.read, r.state = true, loading
			p.Loads = append(p.Loads, r)
			continue
		}
		// A request admitted again after a preemption finds its own
		// blocks in the cache, if they were not evicted.
		n := min(r.PromptTokens+r.generated-s.reusable(r), budget)
		if !s.admit(r, s.reusable(r)+n) {
			break
		}
		n = r.PromptTokens + r.generated - r.computed
		n = min(n, budget)
		s.remove(r)
		r.state = running
		s.running = append(s.running, r)
		p.entries = append(p.entries, entry{r: r, n: n})
		budget -= n
	}
	for _, e := range p.entries {
		if e.r.computed >= e.r.PromptTokens {
			p.DecodeSeqs++
			p.Context += e.r.computed
		} else {
			p.PrefillTokens += e.n
		}
	}
	if len(p.entries) > 0 {
		p.Duration = s.cfg.Cost.Step(p.PrefillTokens, p.DecodeSeqs, p.Context)
		s.stats.Steps++
		s.stats.Busy += p.Duration
	}
	return p
}

// Complete applies a step once its time has passed and says what it did.
// Requests aborted or preempted since Schedule are skipped.
func (s *Scheduler) Complete(p *Plan) []Event {
	var out []Event
	for _, e := range p.entries {
		r := e.r
		if r.state != running {
			continue
		}
		r.computed += e.n
		s.cacheComputed(r)
		if r.computed < r.PromptTokens+r.generated {
			continue // a chunk of a long prompt
		}
		r.generated++
		ev := Event{Req: r, Token: true}
		if r.generated >= r.MaxTokens {
			ev.Done = true
			s.running = slices.DeleteFunc(s.running, func(x *Request) bool { return x == r })
			if r.Kind == Prefill {
				r.state = held
			} else {
				s.free(r)
				r.state = finished
			}
		}
		out = append(out, ev)
	}
	return out
}

// Loaded ends a Decode's KV read. On success it computes only its last
// prompt token; on failure it computes what it did not find locally
// (vLLM's kv_load_failure_policy recompute; for fail, Abort instead).
func (s *Scheduler) Loaded(r *Request, ok bool) {
	if r.state != loading {
		return
	}
	r.state = waiting
	if ok {
		r.computed = r.PromptTokens - 1
		s.cacheComputed(r)
		return
	}
	r.external = 0
}

// Release frees a finished Prefill's held blocks: its decode read them, or
// their lease ran out.
func (s *Scheduler) Release(r *Request) {
	if r.state == held {
		s.free(r)
		r.state = finished
	}
}

// Abort drops a request wherever it is and frees its blocks.
func (s *Scheduler) Abort(r *Request) {
	switch r.state {
	case waiting, loading:
		s.remove(r)
	case running:
		s.running = slices.DeleteFunc(s.running, func(x *Request) bool { return x == r })
	case finished:
		return
	}
	s.free(r)
	r.state = finished
}

// Stats returns the gauges and counters.
func (s *Scheduler) Stats() Stats {
	st := s.stats
	st.Running, st.Waiting = len(s.running), len(s.waiting)
	st.UsedBlocks, st.NumBlocks = s.pool.used(), s.cfg.NumBlocks
	return st
}

// Busy says there is work: running, or waiting (not only for a load).
func (s *Scheduler) Busy() bool {
	if len(s.running) > 0 {
		return true
	}
	for _, r := range s.waiting {
		if r.state == waiting {
			return true
		}
	}
	return false
}
