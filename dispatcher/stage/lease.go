package stage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// A lease is a delivery's hold on its job: NATS gives the job to another
// worker once the ack wait passes without a sign of progress from this
// one. A worker cut off from NATS (a partition, not a restart) cannot
// tell; its engine call goes on, and the job runs twice. The lease bounds
// that:
//
//   - every progress signal is a request, which NATS answers, so the
//     worker knows when its last signal arrived;
//   - once the ack wait has passed since then, the lease has lapsed:
//     NATS has redelivered the job, or will as soon as it is reachable
//     again (a restarted server redelivers what went unsignalled for the
//     ack wait). At the first answer after that, the worker asks whether
//     the job is still its own (its request still wants this generation,
//     and no other delivery runs it, see Loop.onRunning); if not, its
//     engine call stops;
//     and it asks again at each answer for a while after (a redelivered
//     copy still at its own checks answers nobody, see onRunning);
//   - a worker that hears nothing for the ack wait and the stall
//     time-out together stops the engine call while still cut off: by
//     then the job has gone to another worker, which has run it for a
//     stall time-out, or its gateway has given up on a decode that went
//     silent that long.
//
// So once NATS could give the job to another worker, the cut-off one's
// engine goes on with it for no longer than the cut lasts (plus a signal's
// round) and no longer than the stall time-out. Once the handler has
// returned, the lease only signals: the delivery settles as it decided.
// pdq_leases_lapsed_total counts each lapse by how it ended.
type lease struct {
	l     *Loop
	msg   jetstream.Msg
	every time.Duration // between signals
	// stop stops the job's engine call, with errLeaseTaken or errCutOff.
	stop context.CancelCauseFunc
	// ours says whether the job is still this delivery's.
	ours func(context.Context) bool
	log  *slog.Logger

	mu        sync.Mutex
	confirmed time.Time // when NATS last answered a signal (at first, the pull)
	lapsed    bool      // it went the ack wait unanswered, at some time
	unsure    bool      // it has lapsed, and not been found ours since
	kept      bool      // it lapsed, and was found ours once back
	recheck   time.Time // found ours once back: asked again at each answer until then
	settling  bool      // the handler returned: signals only
	judging   bool      // a judge runs (beside the signals, which go on)
	lost      bool      // judged another's: the job stopped
	judges    sync.WaitGroup

	cancel context.CancelFunc
	done   chan struct{}
}

// Causes of a job whose worker no longer holds its delivery. Both count as
// superseded (verdict.Superseded): the delivery settles nothing, as the
// job is another delivery's.
var (
	errLeaseTaken = fmt.Errorf("%w (the job went to another delivery while this worker was cut off from NATS)", reply.ErrSuperseded)
	errCutOff     = fmt.Errorf("%w (this worker was cut off from NATS past the ack wait and the stall time-out)", reply.ErrSuperseded)
)

// ackProgress is JetStream's in-progress signal. nats.go sends it without
// asking for an answer; NATS answers one that asks.
var ackProgress = []byte("+WPI")

// hold signals progress on msg every third of the ack wait until the
// lease is released. stop stops the job when the lease is lost; ours says
// whether the job is still this delivery's.
func (l *Loop) hold(ctx context.Context, msg jetstream.Msg, stop context.CancelCauseFunc, ours func(context.Context) bool, log *slog.Logger) *lease {
	ls := &lease{l: l, msg: msg, every: l.cfg.AckWait / 3, stop: stop, ours: ours, log: log,
		confirmed: time.Now(), done: make(chan struct{})}
	kctx, cancel := context.WithCancel(ctx)
	ls.cancel = cancel
	go ls.run(kctx)
	return ls
}

// settle marks the handler returned: the lease goes on signalling while
// the delivery settles, and no longer judges whether the job is its own
// (its own settling may end the request's record).
func (ls *lease) settle() {
	ls.mu.Lock()
	ls.settling = true
	ls.mu.Unlock()
}

// release stops the signals.
func (ls *lease) release() {
	ls.cancel()
	<-ls.done
	ls.judges.Wait()
}

func (ls *lease) run(ctx context.Context) {
	defer close(ls.done)
	t := time.NewTicker(ls.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if ls.renew(ctx) {
			return
		}
	}
}

// renew sends one signal and judges the lease by its answer (the
// question of ownership beside it, see judge); true once the lease is lost
// (the job stopped) or released.
func (ls *lease) renew(ctx context.Context) (over bool) {
	rctx, cancel := context.WithTimeout(ctx, ls.every)
	_, err := ls.l.nc.RequestWithContext(rctx, ls.msg.Reply(), ackProgress)
	cancel()
	if ctx.Err() != nil {
		return true
	}
	now := time.Now()
	ls.mu.Lock()
	if ls.lost {
		ls.mu.Unlock()
		return true
	}
	if ls.settling {
		ls.mu.Unlock()
		return false
	}
	if err == nil {
		ls.confirmed = now
		if (ls.unsure || now.Before(ls.recheck)) && !ls.judging {
			// Beside the signals: asking may take a second (a running
			// query nobody answers), longer than a signal's round.
			ls.judging = true
			ls.judges.Go(func() { ls.judge(ctx, now) })
		}
		ls.mu.Unlock()
		return false
	}
	silent := now.Sub(ls.confirmed)
	if silent >= ls.l.cfg.AckWait && !ls.unsure {
		ls.lapsed, ls.unsure = true, true
		ls.log.Warn("no answer from NATS for the ack wait: the job may go to another worker", logging.Err(err),
			logging.Ms("silent_ms", silent))
	}
	ls.mu.Unlock()
	if silent >= ls.l.cfg.AckWait+ls.l.cfg.StallTimeout {
		ls.log.Warn("no answer from NATS past the ack wait and the stall time-out: stopping the job, which is another worker's by now",
			logging.Ms("silent_ms", silent))
		ls.stop(errCutOff)
		return true
	}
	return false
}

// judge asks, once NATS answers again after a lapse, whether the job is
// still this delivery's, and stops it if not. A copy redelivered just
// before may still be at its checks, and answers nobody until it runs:
// the question is asked again at each answer for as long as such a copy
// can wait for its own answer, and a signal's round more.
func (ls *lease) judge(ctx context.Context, now time.Time) {
	jctx, cancel := context.WithTimeout(ctx, judgeWait)
	ours := ls.ours(jctx)
	cancel()
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.judging = false
	if ctx.Err() != nil || ls.settling {
		return // released, or settling, meanwhile: the answer means nothing
	}
	if !ours {
		ls.log.Warn("back in touch with NATS: the job went to another delivery meanwhile; stopping this one")
		ls.lost = true
		ls.stop(errLeaseTaken)
		return
	}
	if ls.unsure {
		ls.log.Info("back in touch with NATS: the job is still this delivery's")
		ls.unsure, ls.kept, ls.recheck = false, true, now.Add(runningQueryWaitReconnected+ls.every)
	}
}

// judgeWait bounds a judge: the record's read and a running query (a
// second, just after a reconnect).
const judgeWait = 2 * time.Second

// How a lapsed lease ended, for pdq_leases_lapsed_total.
const (
	lapseKept     = "kept"     // found still this delivery's once back
	lapseStopped  = "stopped"  // found taken over once back (by the lease, the gateway or a cancel): stopped
	lapseCutOff   = "cut_off"  // stopped while still cut off
	lapseFinished = "finished" // the engine call ended first: it may have run twice
)

// outcome is how the lease ended, given the job context's cause and
// whether the delivery was stopped; "" if it never lapsed.
func (ls *lease) outcome(cause error, stopped bool) string {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	switch {
	case !ls.lapsed:
		return ""
	case errors.Is(cause, errCutOff):
		return lapseCutOff
	case stopped, errors.Is(cause, errLeaseTaken):
		return lapseStopped
	case ls.kept && !ls.unsure:
		return lapseKept
	}
	return lapseFinished
}
