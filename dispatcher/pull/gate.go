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

	// mu guards the fields below. isOpen holds it across its JetStream
	// calls: one look at a time.
	mu     sync.Mutex
	open   bool      // the last answer, for the log
	looked time.Time // when the backlog was last looked at
	// pending and idle are what the last look saw (handoffs waiting,
	// decode pulls waiting); since counts the prefills let through after.
	pending, idle, since int
	// headAge is how long the next handoff to be delivered had waited at
	// the last look, by the server's clock. It was stored at headTime,
	// read when the consumer had delivered up to headAfter, at headRead.
	headAge            time.Duration
	headTime, headRead time.Time
	headAfter          uint64
	stream             jetstream.Stream
}

func NewDecodeGate(ctx context.Context, js jetstream.JetStream, pool string, ttl time.Duration, log *slog.Logger) (*DecodeGate, error) {
	registry, err := registry.WatchWorkers(ctx, js, log)
	if err != nil {
		return nil, err
	}
	return &DecodeGate{js: js, pool: pool, ttl: ttl, registry: registry, log: log, fresh: gateFresh}, nil
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
	if time.Since(g.looked) >= g.fresh {
		info, pending, err := g.backlog(ctx)
		if err != nil {
			g.open = true
			return true // no decode consumer yet: nothing is waiting for one
		}
		g.looked, g.pending, g.idle, g.since = time.Now(), pending, info.NumWaiting, 0
		g.headAge = g.waited(ctx, info)
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

// backlog reads the state of the pool's shared decode consumer, and the
// handoffs waiting in it. While a decode worker of the pool takes the
// jobs that prefer its engine, handoffs wait in the engines' consumers
// too (dispatcher.Job.PreferDecode), and all of the pool's are read, in
// one list request: a handoff waits there while its engine is full, until
// another takes it over. Idle slots are the pulls waiting on the shared
// consumer, one a worker with room; the head's wait is the shared
// consumer's.
func (g *DecodeGate) backlog(ctx context.Context) (*jetstream.ConsumerInfo, int, error) {
	shared := dispatcher.ConsumerName(dispatcher.StageDecode, g.pool)
	if !slices.ContainsFunc(g.registry.Engines(dispatcher.StageDecode, g.pool), func(w dispatcher.WorkerInfo) bool { return w.Affinity }) {
		cons, err := g.js.Consumer(ctx, dispatcher.StreamDecode, shared)
		if err != nil {
			return nil, 0, err
		}
		info := cons.CachedInfo() // fresh: Consumer just fetched it
		return info, int(info.NumPending), nil
	}
	infos, err := dispatcher.PoolConsumers(ctx, g.js, dispatcher.StageDecode, g.pool)
	if err != nil {
		return nil, 0, err
	}
	var info *jetstream.ConsumerInfo
	pending := 0
	for _, c := range infos {
		pending += int(c.NumPending)
		if c.Name == shared {
			info = c
		}
	}
	if info == nil {
		return nil, 0, jetstream.ErrConsumerNotFound
	}
	return info, pending, nil
}

// headEvery is how often the gate reads the next handoff to be delivered
// anew: a read fetches the whole message, prompt included.
const headEvery = 250 * time.Millisecond

// waited is how long the next handoff the decode consumer delivers has
// waited: the first of the pool's after the last delivered (a handoff
// waiting to be delivered again is not counted, as NumPending does not
// count it). It is read again only when the consumer has delivered more,
// at most every headEvery; 0 when none waits, or it cannot be read (the
// gate then goes by the reports alone).
func (g *DecodeGate) waited(ctx context.Context, info *jetstream.ConsumerInfo) time.Duration {
	if info.NumPending == 0 {
		g.headTime = time.Time{}
		return 0
	}
	if g.headTime.IsZero() || info.Delivered.Stream != g.headAfter && time.Since(g.headRead) >= headEvery {
		g.headAfter, g.headRead, g.headTime = info.Delivered.Stream, time.Now(), g.stored(ctx, info)
	}
	if g.headTime.IsZero() {
		return 0
	}
	return info.TimeStamp.Sub(g.headTime)
}

// stored is when the next handoff to be delivered was stored; zero if it
// cannot be read.
func (g *DecodeGate) stored(ctx context.Context, info *jetstream.ConsumerInfo) time.Time {
	if g.stream == nil {
		s, err := g.js.Stream(ctx, dispatcher.StreamDecode)
		if err != nil {
			return time.Time{}
		}
		g.stream = s
	}
	m, err := g.stream.GetMsg(ctx, info.Delivered.Stream+1, jetstream.WithGetMsgSubject(info.Config.FilterSubject))
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
