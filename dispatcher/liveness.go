package dispatcher

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// Gateway liveness. A gateway answers pings on GatewaySubject(its id) for
// as long as it runs. NATS answers a request to a subject nobody listens on
// with "no responders" at once, so a worker learns in one round trip that
// the gateway holding a request's client is gone, and stops working for
// nobody. Anything else (a timeout, NATS down) counts as alive: only a
// certain "gone" cancels work.
const (
	pingTimeout  = time.Second
	aliveFor     = time.Second // how long an answer is trusted
	forgetDeadIn = 10 * time.Minute
)

// Liveness answers "does this gateway still run?", with a short cache.
type Liveness struct {
	nc *nats.Conn

	mu     sync.Mutex
	seen   map[string]time.Time // gateway id -> when it last answered
	gone   map[string]time.Time // gateway id -> when it was found gone
	pruned time.Time
}

// NewLiveness pings over nc.
func NewLiveness(nc *nats.Conn) *Liveness {
	return &Liveness{nc: nc, seen: make(map[string]time.Time), gone: make(map[string]time.Time)}
}

// Alive reports whether the gateway with this id still runs. An empty id
// (a replay, which has no client) is alive.
func (l *Liveness) Alive(ctx context.Context, gatewayID string) bool {
	if gatewayID == "" {
		return true
	}
	now := time.Now()
	l.mu.Lock()
	if _, ok := l.gone[gatewayID]; ok {
		l.mu.Unlock()
		return false // gateway ids are never reused
	}
	if t, ok := l.seen[gatewayID]; ok && now.Sub(t) < aliveFor {
		l.mu.Unlock()
		return true
	}
	l.mu.Unlock()

	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	_, err := l.nc.RequestWithContext(ctx, GatewaySubject(gatewayID), nil)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.prune(now)
	if errors.Is(err, nats.ErrNoResponders) {
		l.gone[gatewayID] = now
		delete(l.seen, gatewayID)
		return false
	}
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
	for id, t := range l.gone {
		if now.Sub(t) > forgetDeadIn {
			delete(l.gone, id)
		}
	}
}

// AnswerPings makes this process answer the liveness pings for gatewayID
// until the returned subscription is unsubscribed.
func AnswerPings(nc *nats.Conn, gatewayID string) (*nats.Subscription, error) {
	return nc.Subscribe(GatewaySubject(gatewayID), func(m *nats.Msg) {
		_ = m.Respond(nil) // a lost pong only makes the asker count us alive
	})
}
