package dispatcher

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// pullHeartbeat is how often the server confirms a waiting pull. A pull
// request lives on the server, and on the consumer's leader, it was sent
// to: when that server dies or the leader moves, nobody answers it, and
// only the missing heartbeats (two of them) tell the worker to pull again.
const pullHeartbeat = time.Second

// reconnectPoll is how often a slot looks whether a dropped connection is
// back.
const reconnectPoll = 50 * time.Millisecond

// puller pulls one job at a time for a stage loop, and ends the pulls that
// wait on a connection that dropped, so that a slot pulls again on the
// server the connection comes back to instead of waiting for heartbeats
// that cannot come.
type puller struct {
	nc     *nats.Conn
	mu     sync.Mutex
	ctx    context.Context // the current pulls' scope
	cancel context.CancelFunc
}

// newPuller returns a puller whose pulls end with ctx, or when nc drops.
func newPuller(ctx context.Context, nc *nats.Conn) *puller {
	p := &puller{nc: nc}
	p.ctx, p.cancel = context.WithCancel(ctx)
	status := nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING)
	go func() {
		defer nc.RemoveStatusListener(status)
		for {
			select {
			case <-ctx.Done():
				return
			case <-status:
			}
			p.mu.Lock()
			p.cancel()
			p.ctx, p.cancel = context.WithCancel(ctx)
			p.mu.Unlock()
		}
	}()
	return p
}

// next waits for one job. A pull ended by a dropped connection, or by
// missing heartbeats, returns nats.ErrTimeout, as a pull that found no job:
// the caller just pulls again.
func (p *puller) next(ctx context.Context, cons jetstream.Consumer) (jetstream.Msg, error) {
	// A pull sent while the connection is down would only wait in the
	// client's reconnect buffer, to reach the server stale.
	for !p.nc.IsConnected() {
		if err := sleepCtx(ctx, reconnectPoll); err != nil {
			return nil, err
		}
	}
	p.mu.Lock()
	pctx := p.ctx
	p.mu.Unlock()
	msg, err := cons.Next(jetstream.FetchContext(pctx), jetstream.FetchHeartbeat(pullHeartbeat))
	switch {
	case err == nil:
		return msg, nil
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case pctx.Err() != nil, errors.Is(err, jetstream.ErrNoHeartbeat):
		return nil, nats.ErrTimeout
	}
	return nil, err
}
