package dispatcher

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/pkg/logging"
)

// gateRecheck is how often a closed gate looks at the decode backlog again.
const gateRecheck = 50 * time.Millisecond

// decodeGate is admission by capacity for a prefill stage: it lets a
// prefill start only while the pool's decode backlog (handoffs no decode
// worker has pulled) is smaller than the pool's decode slots. A handoff
// that waits then waits for one slot to free, not for a queue to drain, so
// its KV is read well within its lease; prefilling further ahead would
// only make KV that expires unread.
type decodeGate struct {
	js       jetstream.StreamConsumerManager
	pool     string
	registry *Registry
	log      *slog.Logger

	mu   sync.Mutex
	open bool // the last look's answer, for the log
}

func newDecodeGate(ctx context.Context, js jetstream.JetStream, pool string, log *slog.Logger) (*decodeGate, error) {
	registry, err := WatchWorkers(ctx, js, log)
	if err != nil {
		return nil, err
	}
	return &decodeGate{js: js, pool: pool, registry: registry, log: log}, nil
}

// wait returns once a prefill may start, or when ctx ends.
func (g *decodeGate) wait(ctx context.Context) error {
	for !g.isOpen(ctx) {
		if err := sleepCtx(ctx, gateRecheck); err != nil {
			return err
		}
	}
	return nil
}

func (g *decodeGate) isOpen(ctx context.Context) bool {
	// Every pull looks afresh: a cached "open" would let a burst of fast
	// prefills through before their handoffs show in the backlog.
	g.mu.Lock()
	defer g.mu.Unlock()
	was := g.open
	g.open = true
	cons, err := g.js.Consumer(ctx, StreamDecode, ConsumerName(StageDecode, g.pool))
	if err != nil {
		return true // no decode consumer yet: nothing is waiting for one
	}
	info, err := cons.Info(ctx)
	if err != nil {
		g.log.Debug("could not read the decode backlog; prefilling on", logging.Err(err))
		return true
	}
	slots := max(g.registry.DecodeSlots(g.pool), 1)
	g.open = info.NumPending < uint64(slots)
	if g.open != was {
		g.log.Debug("decode backlog gate", "open", g.open, "handoffs_waiting", info.NumPending, "decode_slots", slots)
	}
	return g.open
}
