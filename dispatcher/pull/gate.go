package pull

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/queues"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// gateRecheck is how often a closed gate looks at the decode backlog again.
const gateRecheck = 50 * time.Millisecond

// gateFresh is how long one look at the decode backlog serves. The look
// reads the decode pool's report (dispatcher/queues), which its reporter
// publishes every queues.BusyEvery while handoffs wait or run; a gate
// that hears none lists the decode consumers itself, at most this often.
// Until the next report, the gate counts the prefills it let through
// since the last as handoffs already waiting, so a burst of fast
// prefills cannot overrun it.
const gateFresh = 50 * time.Millisecond

// gateIdleFresh is how long a look serves that found nothing waiting and
// the gate open, while no prefill has been let through since, for a gate
// that lists the consumers itself. The first prefill let through brings
// the next look back to gateFresh after the last.
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
	watch    *queues.Watch // the decode pool's queues
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
	open   bool           // the last answer, for the log
	looked time.Time      // when the backlog was last looked at
	report *queues.Report // the report of that look
	// pending and idle are what the last report says (handoffs waiting,
	// decode pulls waiting); since counts the prefills let through after.
	pending, idle, since int
	// headAge is how long the next handoff to be delivered had waited at
	// the last report, by the server's clock: the longest of the pool's
	// consumers'.
	headAge time.Duration
}

// NewDecodeGate makes the gate of pool's prefills, which reads watch (the
// pool's decode queues) and counts the decode workers reg hears.
func NewDecodeGate(watch *queues.Watch, reg *registry.Registry, pool string, ttl time.Duration, log *slog.Logger) *DecodeGate {
	return &DecodeGate{watch: watch, pool: pool, ttl: ttl, registry: reg, log: log, fresh: gateFresh, idleFresh: gateIdleFresh}
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
		r, err := g.watch.Latest(ctx, serves)
		if err != nil || r.Shared.Missing {
			g.open = true
			return true // no decode consumer yet: nothing is waiting for one
		}
		g.read(r)
	}
	was := g.open
	g.open = g.decide()
	// Closed by the prefills it let through since a report older than a
	// look: they may have been decoded long since. Ask for news.
	if !g.open && g.since > 0 && g.report != nil && g.report.Age() >= g.fresh {
		if r, err := g.watch.Fresh(ctx, g.fresh); err == nil && !r.Shared.Missing {
			g.read(r)
			g.open = g.decide()
		}
	}
	if g.open != was {
		slots, avg := g.registry.DecodeCapacity(g.pool)
		g.log.Debug("decode backlog gate", "open", g.open, "handoffs_waiting", g.pending+g.since,
			"idle_decode_slots", g.idle, "decode_slots", slots, logging.Ms("avg_decode_ms", avg),
			logging.Ms("oldest_waiting_ms", g.headAge))
	}
	return g.open
}

// read takes the decode pool's report r, when it is news: the prefills
// let through since the last count on. While a decode worker of the pool
// takes the jobs that prefer its engine, handoffs wait in the engines'
// consumers too (dispatcher.Job.PreferDecode), and all of them count: a
// handoff waits there while its engine is full, until another takes it
// over. Otherwise only the pool's shared consumer does: what waits in an
// engine's consumer then (left from before affinity was turned off)
// is no one's to decode, and must not close the gate. g.mu is held.
func (g *DecodeGate) read(r *queues.Report) {
	g.looked = time.Now()
	if r == g.report {
		return
	}
	g.report, g.idle, g.since = r, r.Waiting, 0
	if g.registry.AnyAffinity(dispatcher.StageDecode, g.pool) {
		g.pending, g.headAge = r.Pending, r.Head()
	} else {
		g.pending, g.headAge = r.Shared.Pending, r.Shared.Head()
	}
}

// decide is the gate's answer on its last report, with the prefills let
// through since counted as waiting handoffs. g.mu is held.
func (g *DecodeGate) decide() bool {
	slots, avg := g.registry.DecodeCapacity(g.pool)
	return g.headAge < g.ttl/2 && decodeRoom(g.pending+g.since, g.idle, slots, avg, g.ttl)
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
