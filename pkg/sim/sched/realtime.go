package sched

import (
	"context"
	"sync"
	"time"
)

// Batcher runs an engine's requests through the scheduler model in real
// time: one goroutine plans a step, sleeps its cost, and hands each
// request what the step did. It runs while there is work and stops when
// there is none, so an idle engine costs nothing. It is pdq sim's clock
// for the Scheduler, as PD (virtual.go) is the virtual clock of tests and
// the calibration, so it lives beside the Scheduler it drives; it reports
// the engine's gauges through a callback, so that this package does not
// import the engine's (package sim).
type Batcher struct {
	// mu guards s, seats and looping, and each Seat's tokens, done and
	// kept; gauges is called with it held.
	mu      sync.Mutex
	s       *Scheduler
	seats   map[*Request]*Seat
	looping bool
	// gauges is told the running and waiting requests whenever they may
	// have changed, with mu held: it must not call the Batcher.
	gauges func(running, waiting int)
	// perBlock and perRead price a decode's read of a prefill's blocks.
	perBlock, perRead time.Duration
}

// Seat is one request's place in the batch, as its handler sees it.
type Seat struct {
	r *Request
	// load is closed when the scheduler has given a Decode its blocks:
	// read the KV then.
	load chan struct{}
	// tick says tokens or done changed; it holds at most one signal.
	tick chan struct{}
	// tokens and done are guarded by the batcher's lock; kept is set once
	// a finished prefill's blocks are the KV store's to free (see Close).
	tokens int
	done   bool
	kept   bool
}

// Load is closed when the scheduler has given a Decode its blocks: read
// the KV then, and call Loaded.
func (st *Seat) Load() <-chan struct{} { return st.load }

// NewBatcher builds a batcher on a scheduler of cfg. perBlock and perRead
// price a decode's read of a prefill's blocks (Transfer); gauges, not nil,
// is told the running and waiting requests whenever they may have changed,
// with the batcher's lock held: it must not call the batcher.
func NewBatcher(cfg Config, perBlock, perRead time.Duration, gauges func(running, waiting int)) (*Batcher, error) {
	s, err := New(cfg)
	if err != nil {
		return nil, err
	}
	return &Batcher{s: s, seats: make(map[*Request]*Seat), gauges: gauges, perBlock: perBlock, perRead: perRead}, nil
}

// Add queues a request.
func (b *Batcher) Add(r *Request) (*Seat, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.s.Add(r); err != nil {
		return nil, err
	}
	st := &Seat{r: r, load: make(chan struct{}), tick: make(chan struct{}, 1)}
	b.seats[r] = st
	b.kickLocked()
	return st, nil
}

// Loaded ends a Decode's KV read; a Decode that will stop after n tokens
// (the answer of the prompt its KV holds) says so first.
func (b *Batcher) Loaded(st *Seat, ok bool, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st.r.MaxTokens = min(st.r.MaxTokens, n)
	b.s.Loaded(st.r, ok)
	b.kickLocked()
}

// Keep says a finished request's blocks are freed from now on by its
// KV hold (or at once, when there is none): finished's freed callback.
func (b *Batcher) Keep(st *Seat) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st.kept = true
}

// Release frees a finished prefill's held blocks.
func (b *Batcher) Release(r *Request) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.s.Release(r)
	b.kickLocked()
}

// Close ends a request's seat: a request that has not finished is aborted
// and its blocks freed; a finished prefill's stay held until Release.
func (b *Batcher) Close(st *Seat) {
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

// Wait returns once the request has more than have tokens, or is done, or
// ctx ends.
func (b *Batcher) Wait(ctx context.Context, st *Seat, have int) (tokens int, done bool, err error) {
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

// Transfer is the time to read a decode's KV: its blocks not found in the
// local prefix cache.
func (b *Batcher) Transfer(st *Seat, blockSize int) time.Duration {
	blocks := (st.r.ExternalTokens() + blockSize - 1) / blockSize
	return b.perRead + time.Duration(blocks)*b.perBlock
}

// Stats returns the scheduler's gauges and counters.
func (b *Batcher) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.s.Stats()
}

func (b *Batcher) kickLocked() {
	b.gaugesLocked()
	if !b.looping && b.s.Busy() {
		b.looping = true
		go b.loop()
	}
}

func (b *Batcher) gaugesLocked() {
	st := b.s.Stats()
	b.gauges(st.Running, st.Waiting)
}

func (b *Batcher) loop() {
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
