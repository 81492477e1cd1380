package pull

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// gateRecheck is how often a closed gate looks at the decode backlog again.
const gateRecheck = 50 * time.Millisecond

// gateFresh is how long one look at the decode backlog serves. A look is a
// JetStream API request that the server answers from the consumer's state
// under its lock; made before every pull, it was one of the larger costs
// in profiles under load (docs/benchmarks.md). Within gateFresh the gate
// counts the prefills it let through since the look as handoffs already
// waiting, so a burst of fast prefills cannot overrun it.
const gateFresh = 50 * time.Millisecond

// gateIdleFresh is how long a look serves that found nothing waiting and
// the gate open, while no prefill has been let through since: an idle
// pool's prefill workers looked 4 times a second each, a list of every
// decode consumer each time (docs/scaling.md). The first prefill let
// through brings the next look back to gateFresh after the last.
const gateIdleFresh = time.Second

// DecodeGate is admission by capacity for a prefill stage: a prefill
// starts only while its handoff can be expected to start decoding within
// the KV TTL. Prefilling further ahead would only make KV that expires
// unread. See [decodeRoom].
//
// What decodeRoom expects rests on the decode workers' reports (their
// slots, how long their decodes took), which lag, and are wrong for a
// while after a worker starts: its first decodes may be short. So the gate
// also looks at the handoff at the head of the queue: while it has waited
// half the TTL, a new one would wait at least as long, and the gate stays
// closed whatever the reports say.
//
// The pull goroutines of a prefill stage loop call Wait and Took (one, or
// one a consumer with affinity); mu guards the fields below.
type DecodeGate struct {
	// Set by NewDecodeGate, read without a lock.
	js       jetstream.JetStream
	pool     string
	ttl      time.Duration
	registry *registry.Registry // has its own lock
	log      *slog.Logger

	fresh time.Duration // how long a look serves: gateFresh; tests change it between calls
	// idleFresh is how long a look that found the pool idle serves:
	// gateIdleFresh; tests that look again at will set it to 0.
	idleFresh time.Duration

	// mu guards the fields below. isOpen holds it across its JetStream
	// calls: one look at a time.
	mu     sync.Mutex
	open   bool      // the last answer, for the log
	looked time.Time // when the backlog was last looked at
	// pending and idle are what the last look saw (handoffs waiting,
	// decode pulls waiting); since counts the prefills let through after.
	pending, idle, since int
	// headAge is how long the next handoff to be delivered had waited at
	// the last look, by the server's clock: the longest of the pool's
	// consumers' (see heads).
	headAge time.Duration
	heads   map[string]*head // consumer name → its next handoff
	stream  jetstream.Stream
}

// head is the next handoff a consumer delivers: stored at time, read when
// the consumer had delivered up to after, at read.
type head struct {
	time, read time.Time
	after      uint64
}

func NewDecodeGate(ctx context.Context, js jetstream.JetStream, pool string, ttl time.Duration, log *slog.Logger) (*DecodeGate, error) {
	registry, err := registry.WatchWorkers(ctx, js, log)
	if err != nil {
		return nil, err
	}
	return &DecodeGate{js: js, pool: pool, ttl: ttl, registry: registry, log: log, fresh: gateFresh, idleFresh: gateIdleFresh,
		heads: map[string]*head{}}, nil
}

// Wait returns once a prefill may start, or when ctx ends.
func (g *DecodeGate) Wait(ctx context.Context) error {
	for !g.isOpen(ctx) {
		if err := sleep.For(ctx, gateRecheck); err != nil {
			return err
		}
	}
	return nil
}

// Took counts a prefill let through by the gate: a pull that Wait let go
// brought a job. Only jobs count: a pull that comes back empty (and a
// loop may have several pulls waiting, one on each of its consumers)
// adds no handoff.
func (g *DecodeGate) Took() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.since++
}

// isOpen decides on a look at the decode backlog at most gateFresh old,
// with the prefills let through since counted as waiting handoffs: a
// stale "open" would let a burst of fast prefills through before their
// handoffs show.
func (g *DecodeGate) isOpen(ctx context.Context) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	serves := g.fresh
	if g.open && g.pending == 0 && g.since == 0 && g.headAge == 0 {
		serves = max(serves, g.idleFresh)
	}
	if time.Since(g.looked) >= serves {
		shared, all, err := g.backlog(ctx)
		if err != nil {
			g.open = true
			return true // no decode consumer yet: nothing is waiting for one
		}
		g.looked, g.pending, g.idle, g.since, g.headAge = time.Now(), 0, shared.NumWaiting, 0, 0
		seen := map[string]bool{}
		for _, info := range all {
			seen[info.Name] = true
			g.pending += int(info.NumPending)
			g.headAge = max(g.headAge, g.waited(ctx, info))
		}
		for name := range g.heads {
			if !seen[name] {
				delete(g.heads, name)
			}
		}
	}
	was, waiting := g.open, g.pending+g.since
	slots, avg := g.registry.DecodeCapacity(g.pool)
	g.open = g.headAge < g.ttl/2 && decodeRoom(waiting, g.idle, slots, avg, g.ttl)
	if g.open != was {
		g.log.Debug("decode backlog gate", "open", g.open, "handoffs_waiting", waiting,
			"idle_decode_slots", g.idle, "decode_slots", slots, logging.Ms("avg_decode_ms", avg),
			logging.Ms("oldest_waiting_ms", g.headAge))
	}
	return g.open
}

// Preferable says whether a handoff may prefer the decode engine keyed
// engine (dispatcher.Job.PreferDecode): while every live decode worker of
// the pool takes the jobs that prefer its engine, that one among them.
// Otherwise it goes to the pool's queue: a decode worker of an earlier
// build, or with PDQ_AFFINITY off, neither pulls an engine's jobs nor
// takes them over, so during a rollback or with affinity turned off on
// the decode workers a preferred handoff could wait for nobody; and one
// that prefers an engine gone would wait for a take-over.
func (g *DecodeGate) Preferable(engine string) bool {
	workers := g.registry.Engines(dispatcher.StageDecode, g.pool)
	return dispatcher.AllTakePreferred(workers) &&
		slices.ContainsFunc(workers, func(w dispatcher.WorkerInfo) bool { return dispatcher.EngineKey(w.Engine) == engine })
}

// backlog reads the state of the pool's shared decode consumer (shared),
// and of every consumer that holds the pool's handoffs (all, shared
// included). While a decode worker of the pool takes the jobs that prefer
// its engine, handoffs wait in the engines' consumers too
// (dispatcher.Job.PreferDecode), and all of the pool's are read, in one
// list request: a handoff waits there while its engine is full, until
// another takes it over. Idle slots are the pulls waiting on the shared
// consumer, one a worker with room.
func (g *DecodeGate) backlog(ctx context.Context) (shared *jetstream.ConsumerInfo, all []*jetstream.ConsumerInfo, err error) {
	name := dispatcher.ConsumerName(dispatcher.StageDecode, g.pool)
	if !slices.ContainsFunc(g.registry.Engines(dispatcher.StageDecode, g.pool), func(w dispatcher.WorkerInfo) bool { return w.Affinity }) {
		cons, err := g.js.Consumer(ctx, dispatcher.StreamDecode, name)
		if err != nil {
			return nil, nil, err
		}
		info := cons.CachedInfo() // fresh: Consumer just fetched it
		return info, []*jetstream.ConsumerInfo{info}, nil
	}
	if all, err = dispatcher.PoolConsumers(ctx, g.js, dispatcher.StageDecode, g.pool); err != nil {
		return nil, nil, err
	}
	for _, c := range all {
		if c.Name == name {
			return c, all, nil
		}
	}
	return nil, nil, jetstream.ErrConsumerNotFound
}

// headEvery is how often the gate reads the next handoff to be delivered
// anew: a read fetches the whole message, prompt included.
const headEvery = 250 * time.Millisecond

// waited is how long the next handoff a consumer delivers has waited: the
// first of the pool's after the last delivered (a handoff waiting to be
// delivered again is not counted, as NumPending does not count it). It is
// read again only when the consumer has delivered more, at most every
// headEvery; 0 when none waits, or it cannot be read (the gate then goes
// by the reports alone).
func (g *DecodeGate) waited(ctx context.Context, info *jetstream.ConsumerInfo) time.Duration {
	if info.NumPending == 0 {
		delete(g.heads, info.Name)
		return 0
	}
	h := g.heads[info.Name]
	if h == nil {
		h = &head{}
		g.heads[info.Name] = h
	}
	if h.time.IsZero() || info.Delivered.Stream != h.after && time.Since(h.read) >= headEvery {
		h.after, h.read, h.time = info.Delivered.Stream, time.Now(), nextStored(ctx, g.js, &g.stream, info)
	}
	if h.time.IsZero() {
		return 0
	}
	return info.TimeStamp.Sub(h.time)
}

// nextStored is when the next job the consumer of info delivers (the
// first of its filter after the last it delivered) was stored; zero if it
// cannot be read. Its stream, found at the first call, is kept in *st.
// The decode gate reads a handoff's age with it, the take-over a job's.
func nextStored(ctx context.Context, js jetstream.JetStream, st *jetstream.Stream, info *jetstream.ConsumerInfo) time.Time {
	if *st == nil {
		s, err := js.Stream(ctx, info.Stream)
		if err != nil {
			return time.Time{}
		}
		*st = s
	}
	m, err := (*st).GetMsg(ctx, info.Delivered.Stream+1, jetstream.WithGetMsgSubject(info.Config.FilterSubject))
	if err != nil {
		return time.Time{}
	}
	return m.Time
}

// decodeRoom decides whether one more handoff can be expected to start
// decoding within ttl. pending handoffs wait in the queue, idle decode
// slots wait for work (their pulls), slots is the pool's decode
// concurrency and avg how long a decode takes (0: not known yet).
//
// A new handoff starts at once while idle slots outnumber the waiting
// handoffs. Otherwise it waits for the decodes ahead of it: about
// (pending-idle+1)/slots rounds of avg, which must fit in half the TTL:
// decodes vary in length, and an average is a guess. Without an average,
// it waits at most one decode as long as fewer handoffs wait than there
// are slots.
func decodeRoom(pending, idle, slots int, avg, ttl time.Duration) bool {
	if pending < idle {
		return true
	}
	slots = max(slots, 1)
	if avg <= 0 {
		return pending < slots
	}
	ahead := pending - idle + 1
	rounds := (ahead + slots - 1) / slots
	return time.Duration(rounds)*avg < ttl/2
}
