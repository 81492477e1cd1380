package stage

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
)

// onCancel stops the running jobs of a cancelled request: those of its
// origin (see Job.Origin). A cancel or a job without one (from a gateway
// of an older build) matches by id alone.
func (l *Loop) onCancel(msg *nats.Msg) {
	id := msg.Subject[len(dispatcher.CancelSubject("")):]
	origin, _ := strconv.Atoi(msg.Header.Get(dispatcher.HeaderOrigin))
	l.mu.Lock()
	defer l.mu.Unlock()
	for r := range l.running {
		if r.id == id && (origin == 0 || r.origin == 0 || r.origin == origin) {
			r.cancel(errCancelled)
		}
	}
}

// sampleDepth publishes how many jobs wait in this loop's queue, every
// heartbeat interval, until ctx ends. It runs on its own, with a short
// time-out, so that a slow JetStream delays no heartbeat.
func (l *Loop) sampleDepth(ctx context.Context) {
	if l.cfg.Metrics == nil {
		return
	}
	t := time.NewTicker(dispatcher.HeartbeatInterval)
	defer t.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		r, err := l.queues.Latest(qctx, dispatcher.HeartbeatInterval) // the engines' consumers too (affinity)
		cancel()
		if err == nil { // else NATS away: the last value stands
			l.cfg.Metrics.depth(l.cfg.Stage, l.cfg.Pool, uint64(r.Pending))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// onRunning answers whether this loop runs another delivery of the job a
// query names (its id, generation and the asker's delivery): a job
// redelivered while its first delivery still runs. A gateway's query
// (dispatcher.HeaderBeating) asks instead whether a delivery of the job
// has beaten for at least as long as it says.
func (l *Loop) onRunning(msg *nats.Msg) {
	id := msg.Subject[len(dispatcher.RunningSubject("")):]
	gen, _ := strconv.Atoi(msg.Header.Get(dispatcher.HeaderGeneration))
	asker, _ := strconv.Atoi(msg.Header.Get(dispatcher.HeaderAttempt))
	delivery := msg.Header.Get(dispatcher.HeaderDelivery) // empty from a build before it
	stage := dispatcher.Stage(msg.Header.Get(dispatcher.HeaderStage))
	if stage != l.cfg.Stage {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if v := msg.Header.Get(dispatcher.HeaderBeating); v != "" {
		ms, _ := strconv.ParseInt(v, 10, 64)
		beat := func(id2 string, gen2 int, since time.Time) bool {
			return id2 == id && gen2 == gen && !since.IsZero() && time.Since(since) >= time.Duration(ms)*time.Millisecond
		}
		for r := range l.running {
			if beat(r.id, r.generation, r.beating) {
				_ = msg.Respond(nil) // a lost answer only lets the gateway wait on
				return
			}
		}
		for _, a := range l.answered {
			if time.Now().Before(a.until) && beat(a.id, a.generation, a.began) {
				_ = msg.Respond(nil)
				return
			}
		}
		return
	}
	for r := range l.running {
		other := r.attempt != asker
		if delivery != "" {
			other = r.delivery != delivery
		}
		// A delivery answers once it runs, or while at its checks when
		// it is the earlier: of two copies at their checks, the later
		// gives way.
		if r.id == id && r.generation == gen && other && (r.admitted || r.attempt < asker) {
			_ = msg.Respond(nil) // a lost answer only costs a duplicate run
			return
		}
	}
}

// runningElsewhere asks the stage loops whether another delivery of this
// job still runs. NATS redelivers a job whose worker could not signal
// progress for the ack wait, as when the worker was cut off from NATS
// while its engine call went on.
func (l *Loop) runningElsewhere(ctx context.Context, job *dispatcher.Job, attempt int, delivery string) bool {
	m := nats.NewMsg(dispatcher.RunningSubject(job.ID))
	m.Header[dispatcher.HeaderGeneration] = []string{strconv.Itoa(job.Generation)}
	m.Header[dispatcher.HeaderAttempt] = []string{strconv.Itoa(attempt)}
	m.Header[dispatcher.HeaderDelivery] = []string{delivery}
	m.Header[dispatcher.HeaderStage] = []string{string(l.cfg.Stage)}
	wait := runningQueryWait
	if l.reconnectedWithin(10 * time.Second) {
		wait = runningQueryWaitReconnected
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	_, err := l.nc.RequestMsgWithContext(ctx, m)
	return err == nil
}

// The waits for an answer to a running query. A loop that runs the job
// answers within a round trip; only loops that run it answer, so every
// query nobody answers costs the whole wait. Just after a NATS restart,
// processes reconnect up to a few hundred milliseconds apart (they retry
// every 250 ms), so a loop that reconnected lately waits longer.
const (
	runningQueryWait            = 100 * time.Millisecond
	runningQueryWaitReconnected = time.Second
)

// reconnectedWithin reports whether this loop's connection came back from
// an outage within d, as far as its queries have seen.
func (l *Loop) reconnectedWithin(d time.Duration) bool {
	n := l.nc.Stats().Reconnects
	l.mu.Lock()
	defer l.mu.Unlock()
	if n != l.reconnects {
		l.reconnects, l.reconnectedAt = n, time.Now()
	}
	return !l.reconnectedAt.IsZero() && time.Since(l.reconnectedAt) < d
}

// watchGateways stops the running jobs whose gateway is gone: nobody would
// read their output.
func (l *Loop) watchGateways(ctx context.Context) {
	t := time.NewTicker(dispatcher.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		l.mu.Lock()
		byGateway := make(map[string][]context.CancelCauseFunc)
		for r := range l.running {
			if r.gateway != "" {
				byGateway[r.gateway] = append(byGateway[r.gateway], r.cancel)
			}
		}
		l.mu.Unlock()
		for gw, cancels := range byGateway {
			if l.liveness.Alive(ctx, gw) {
				continue
			}
			l.log.Warn("gateway gone: stopping its running jobs", "gateway_id", gw, "jobs", len(cancels))
			for _, c := range cancels {
				c(errGatewayGone)
			}
		}
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
