package registry

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
)

// Gateway liveness. A gateway answers pings on GatewaySubject(its id) for
// as long as it runs. NATS answers a request to a subject nobody listens on
// with "no responders" at once, so a worker learns cheaply that the gateway
// holding a request's client is gone, and stops working for nobody. But a
// gateway whose connection blipped, or that reconnects after a NATS
// restart, is briefly unheard too. So a gateway is gone only after
// goneAfter of unbroken silence (no answer at any ping in between, and no
// gap between pings longer than silenceGap), heard while this process's
// own connection had been up for goneAfter. Anything else (an answer, a
// timeout, NATS down) counts as alive.
const (
	pingTimeout = time.Second
	aliveFor    = time.Second // how old an answer gets before it is renewed
	goneAfter   = 4 * time.Second
	silenceGap  = 2*dispatcher.HeartbeatInterval + time.Second
)

// Liveness answers "does this gateway still run?", with a short cache.
//
// Alive may be called from any goroutine, any number at once: a stage
// loop's jobs and its watchGateways, a gateway's submits. A ping Alive
// does not wait for runs in a goroutine of its own.
type Liveness struct {
	nc *nats.Conn // set by NewLiveness, read without a lock

	// mu guards the fields below. No ping is sent under it.
	mu         sync.Mutex
	seen       map[string]time.Time // gateway id -> when it last answered
	asking     map[string]bool      // gateway ids pinged in the background
	silent     map[string]silence
	pruned     time.Time
	reconnects uint64
	stable     time.Time // since when this connection has been up
}

// silence is an unbroken run of unanswered pings to one gateway.
type silence struct{ first, last time.Time }

// NewLiveness pings over nc.
func NewLiveness(nc *nats.Conn) *Liveness {
	return &Liveness{nc: nc, seen: make(map[string]time.Time), asking: make(map[string]bool), silent: make(map[string]silence),
		reconnects: nc.Stats().Reconnects, stable: time.Now()}
}

// Alive reports whether the gateway with this id still runs. An empty id
// (a replay, which has no client) is alive.
func (l *Liveness) Alive(ctx context.Context, gatewayID string) bool {
	if gatewayID == "" {
		return true
	}
	now := time.Now()
	l.mu.Lock()
	if t, ok := l.seen[gatewayID]; ok && now.Sub(t) < goneAfter {
		// A gateway that answered within goneAfter is alive whatever a
		// ping says now: gone takes goneAfter of silence since its last
		// answer. Past aliveFor the ping that keeps the answer fresh goes
		// out behind the caller, which does not wait for it.
		if now.Sub(t) >= aliveFor && !l.asking[gatewayID] {
			l.asking[gatewayID] = true
			go l.ping(context.WithoutCancel(ctx), gatewayID, true)
		}
		l.mu.Unlock()
		return true
	}
	l.mu.Unlock()
	return l.ping(ctx, gatewayID, false)
}

// ping asks the gateway whether it runs, and judges its silence; behind
// marks the ping Alive sent out without waiting for it.
func (l *Liveness) ping(ctx context.Context, gatewayID string, behind bool) bool {
	now := time.Now()
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	_, err := l.nc.RequestWithContext(ctx, dispatcher.GatewaySubject(gatewayID), nil)
	l.mu.Lock()
	defer l.mu.Unlock()
	if behind {
		delete(l.asking, gatewayID)
	}
	l.prune(now)
	if n := l.nc.Stats().Reconnects; n != l.reconnects {
		l.reconnects, l.stable = n, now
	}
	if errors.Is(err, nats.ErrNoResponders) {
		sl, ok := l.silent[gatewayID]
		if !ok || now.Sub(sl.last) > silenceGap || sl.first.Before(l.stable) {
			sl.first = now // a new run: the old one is too old to count
		}
		sl.last = now
		l.silent[gatewayID] = sl
		return now.Sub(sl.first) < goneAfter || now.Sub(l.stable) < goneAfter
	}
	delete(l.silent, gatewayID)
	if err == nil {
		l.seen[gatewayID] = now
	}
	return true
}

func (l *Liveness) prune(now time.Time) {
	if now.Sub(l.pruned) < time.Minute {
		return
	}
	l.pruned = now
	for id, t := range l.seen {
		if now.Sub(t) > time.Minute {
			delete(l.seen, id)
		}
	}
	for id, sl := range l.silent {
		if now.Sub(sl.last) > time.Minute {
			delete(l.silent, id)
		}
	}
}

// AnswerPings makes this process answer the liveness pings for gatewayID
// until the returned subscription is unsubscribed.
func AnswerPings(nc *nats.Conn, gatewayID string) (*nats.Subscription, error) {
	return nc.Subscribe(dispatcher.GatewaySubject(gatewayID), func(m *nats.Msg) {
		_ = m.Respond(nil) // a lost pong only makes the asker count us alive
	})
}
