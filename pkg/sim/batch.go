package sim

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/pkg/sim/kvstore"
	"github.com/pdq-dev/pdq/pkg/sim/sched"
)

// batcher runs an engine's requests through vLLM's scheduler model
// (package sched) in real time: one goroutine plans a step, sleeps its
// cost, and hands each request what the step did. It runs while there is
// work and stops when there is none, so an idle engine costs nothing.
type batcher struct {
	mu      sync.Mutex
	s       *sched.Scheduler
	seats   map[*sched.Request]*seat
	looping bool
	stats   *counters
	// perBlock and perRead price a decode's read of a prefill's blocks.
	perBlock, perRead time.Duration
}

// seat is one request's place in the batch, as its handler sees it.
type seat struct {
	r *sched.Request
	// load is closed when the scheduler has given a Decode its blocks:
	// read the KV then.
	load chan struct{}
	// tick says tokens or done changed; it holds at most one signal.
	tick chan struct{}
	// tokens and done are guarded by the batcher's lock; kept is set once
	// a finished prefill's blocks are the KV store's to free (see close).
	tokens int
	done   bool
	kept   bool
}

func newBatcher(cfg sched.Config, perBlock, perRead time.Duration, stats *counters) (*batcher, error) {
	s, err := sched.New(cfg)
	if err != nil {
		return nil, err
	}
	return &batcher{s: s, seats: make(map[*sched.Request]*seat), stats: stats, perBlock: perBlock, perRead: perRead}, nil
}

// add queues a request.
func (b *batcher) add(r *sched.Request) (*seat, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.s.Add(r); err != nil {
		return nil, err
	}
	st := &seat{r: r, load: make(chan struct{}), tick: make(chan struct{}, 1)}
	b.seats[r] = st
	b.kickLocked()
	return st, nil
}

// loaded ends a Decode's KV read; a Decode that will stop after n tokens
// (the answer of the prompt its KV holds) says so first.
func (b *batcher) loaded(st *seat, ok bool, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st.r.MaxTokens = min(st.r.MaxTokens, n)
	b.s.Loaded(st.r, ok)
	b.kickLocked()
}

// keep says a finished request's blocks are freed from now on by its
// KV hold (or at once, when there is none): finished's freed callback.
func (b *batcher) keep(st *seat) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st.kept = true
}

// release frees a finished prefill's held blocks.
func (b *batcher) release(r *sched.Request) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.s.Release(r)
	b.kickLocked()
}

// close ends a request's seat: a request that has not finished is aborted
// and its blocks freed; a finished prefill's stay held until release.
func (b *batcher) close(st *seat) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case !st.done:
		b.s.Abort(st.r)
		b.kickLocked()
	case !st.kept:
		// Its handler failed after the last token: no hold will free a
		// finished prefill's blocks.
		b.s.Release(st.r)
		b.kickLocked()
	}
	delete(b.seats, st.r)
	b.gaugesLocked()
}

// wait returns once the request has more than have tokens, or is done, or
// ctx ends.
func (b *batcher) wait(ctx context.Context, st *seat, have int) (tokens int, done bool, err error) {
	for {
		b.mu.Lock()
		tokens, done = st.tokens, st.done
		b.mu.Unlock()
		if tokens > have || done {
			return tokens, done, nil
		}
		select {
		case <-st.tick:
		case <-ctx.Done():
			return tokens, done, ctx.Err()
		}
	}
}

// transfer is the time to read a decode's KV: its blocks not found in the
// local prefix cache.
func (b *batcher) transfer(st *seat, blockSize int) time.Duration {
	blocks := (st.r.ExternalTokens() + blockSize - 1) / blockSize
	return b.perRead + time.Duration(blocks)*b.perBlock
}

func (b *batcher) stepStats() sched.Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.s.Stats()
}

func (b *batcher) kickLocked() {
	b.gaugesLocked()
	if !b.looping && b.s.Busy() {
		b.looping = true
		go b.loop()
	}
}

func (b *batcher) gaugesLocked() {
	st := b.s.Stats()
	b.stats.running.Store(int64(st.Running))
	b.stats.waiting.Store(int64(st.Waiting))
}

func (b *batcher) loop() {
	for {
		b.mu.Lock()
		p := b.s.Schedule()
		for _, r := range p.Loads {
			if st, ok := b.seats[r]; ok {
				close(st.load)
			}
		}
		b.gaugesLocked()
		if p.Empty() {
			if len(p.Preempted) > 0 && b.s.Busy() {
				// A step that only preempted admits nothing, as vLLM's;
				// the next step does.
				b.mu.Unlock()
				continue
			}
			b.looping = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		time.Sleep(p.Duration)
		b.mu.Lock()
		for _, ev := range b.s.Complete(p) {
			st, ok := b.seats[ev.Req]
			if !ok {
				continue
			}
			st.tokens = ev.Req.Generated()
			st.done = ev.Done
			select {
			case st.tick <- struct{}{}:
			default:
			}
		}
		b.mu.Unlock()
	}
}

// executeBatched is execute on a batched engine: the request waits in the
// scheduler's queue, reads its KV when the scheduler gives it blocks (a
// decode), and says each token as a step samples it.
func (e *Engine) executeBatched(ctx context.Context, j *job, noKV bool, emit func(token) error) (outcome, error) {
	defer j.markLoaded()
	if j.loadAfter != nil {
		select {
		case <-j.loadAfter:
		case <-ctx.Done():
			return outcome{}, ctx.Err()
		}
	}
	digest := j.prompt.Digest
	n, finish := e.outputLength(j, digest)
	r := &sched.Request{ID: j.internalID, Kind: sched.Local, PromptTokens: j.prompt.Tokens, Hashes: j.hashes,
		MaxTokens: n, Priority: j.req.Priority}
	switch j.mode {
	case modePrefill:
		r.Kind = sched.Prefill
	case modeDecode:
		// How many tokens it says depends on the KV it reads.
		r.Kind, r.MaxTokens = sched.Decode, j.maxTokens
	}
	st, err := e.batch.add(r)
	if err != nil {
		return outcome{}, err
	}
	defer e.batch.close(st)

	if j.mode == modeDecode {
		stopHeartbeat := e.heartbeat(ctx, j)
		select {
		case <-st.load:
		case <-ctx.Done():
		}
		stopHeartbeat()
		if ctx.Err() != nil {
			e.releaseRemote(ctx, j)
			return outcome{}, ctx.Err()
		}
		loaded, err := e.loadKV(ctx, j, e.batch.transfer(st, e.cfg.BlockSize))
		j.markLoaded()
		var recompute bool
		if digest, recompute, err = e.judgeLoad(ctx, j, loaded, err); err != nil {
			return outcome{}, err
		}
		n, finish = e.outputLength(j, digest)
		e.batch.loaded(st, !recompute, n)
	}

	for i := 0; i < n; {
		got, done, err := e.batch.wait(ctx, st, i)
		if err != nil {
			return outcome{}, err
		}
		for ; i < min(got, n); i++ {
			if e.dead.Load() {
				return outcome{}, kvstore.ErrEngineDead
			}
			t := token{i: i, n: n, text: j.gen.Token(digest, i)}
			if i == 0 && j.prompt.MidWord {
				t.text = " " + t.text
			}
			if i == n-1 {
				t.finish = finish
			}
			if err := emit(t); err != nil {
				return outcome{}, err
			}
		}
		if done && i < n {
			return outcome{}, fmt.Errorf("sim: scheduler ended %s after %d of %d tokens", j.internalID, i, n)
		}
	}
	e.batch.keep(st)
	out, err := e.finished(j, n, finish, noKV, func() { e.batch.release(r) })
	out.cached = r.CachedTokens()
	return out, err
}
