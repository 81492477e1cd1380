package stage

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime/debug"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// process runs one delivery: check it may run at all, run it, and settle
// it. pullCtx ends at shutdown, jobCtx at the end of the grace period.
// The permit Ready granted the pull is given back when the handler never
// gets the job (it was dropped, or stopped, before it ran).
func (l *Loop) process(pullCtx, jobCtx context.Context, msg jetstream.Msg, permit Permit, engineHeld bool) {
	handled := false
	defer func() {
		if !handled {
			permit.release()
		}
	}()
	// The engine slot, when held (from the pull, or taken below), is given
	// back once, however process ends.
	defer func() {
		if engineHeld {
			l.cfg.EngineSlots.Release()
		}
	}()
	attempt, stored := deliveryOf(msg) // stored: when the job's message was stored
	// Settling must finish even when the grace period is over; each NATS
	// call in it has the client's own default timeout.
	sctx := context.WithoutCancel(jobCtx)
	job, err := dispatcher.ParseJob(msg.Headers(), msg.Data())
	if err != nil {
		l.unreadable(sctx, msg, job, err)
		return
	}
	jctx, cancel := context.WithCancelCause(jobCtx)
	defer cancel(nil)
	s := l.settleOf(msg, job, attempt)
	// The job stays in progress from its pull until it is settled: the
	// checks before it runs (a KV release) and storing a handoff or a dead
	// letter may take longer than the ack wait. A worker cut off from
	// NATS meanwhile loses the lease, and its engine call stops (see
	// lease).
	ls := l.hold(jobCtx, msg, cancel, func(ctx context.Context) bool {
		return l.wanted(job)(ctx) && !l.runningElsewhere(ctx, job, attempt, s.delivery)
	}, s.log)
	defer ls.release()
	// Each lapse is counted, however the delivery ends (stopped: the
	// handler stopped, by the lease, the gateway or a cancel).
	stopped := false
	defer func() {
		if lapse := ls.outcome(context.Cause(jctx), stopped); lapse != "" {
			l.cfg.Metrics.lapsed(l.cfg.Stage, lapse)
		}
	}()
	if !job.Deadline.IsZero() {
		// Every engine call of the job ends at the request's deadline,
		// whether or not a gateway is there to cancel it (a replay has
		// none, and a cancel may be lost).
		var stop context.CancelFunc
		jctx, stop = context.WithDeadlineCause(jctx, job.Deadline, errExpired)
		defer stop()
	}
	// It is registered before the checks, so that a cancel broadcast sent
	// while they run is not missed.
	r := &runningJob{id: job.ID, gateway: job.GatewayID(), generation: job.Generation, origin: job.Origin, attempt: attempt,
		delivery: s.delivery, cancel: cancel}
	l.mu.Lock()
	l.running[r] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.running, r)
		l.mu.Unlock()
	}()

	// The engine slot is held before the checks, so that a handoff that
	// waited for it is judged by its age after the wait, and a KV release
	// on the way runs in it; it is given back as soon as the engine is
	// done, before settling.
	if e := l.cfg.EngineSlots; e != nil && !engineHeld {
		wctx, stop := context.WithCancel(jctx)
		unhook := context.AfterFunc(pullCtx, stop)
		err := e.Acquire(wctx)
		unhook()
		stop()
		switch cause := context.Cause(jctx); {
		case err == nil:
			engineHeld = true
		case errors.Is(cause, errCancelled), errors.Is(cause, errGatewayGone), errors.Is(cause, errExpired):
			// Settled below, without a slot: it will not run.
		case errors.Is(cause, reply.ErrSuperseded):
			return // its lease lost: the job is another delivery's
		default:
			// The loop stops (a shutdown, or its model gone) before the
			// job ran.
			s.unrun(sctx, errors.New("the worker stopped before the job ran"))
			return
		}
	}
	s.engineHeld = engineHeld
	releaseEngine := func() {
		if engineHeld {
			engineHeld, s.engineHeld = false, false
			l.cfg.EngineSlots.Release()
		}
	}
	if !s.admit(sctx) {
		return
	}
	switch cause := context.Cause(jctx); {
	case errors.Is(cause, errCancelled), errors.Is(cause, errGatewayGone):
		s.stopped(sctx, cause)
		return
	case errors.Is(cause, errExpired):
		s.expired(sctx)
		return
	case errors.Is(cause, reply.ErrSuperseded):
		return // its lease lost during the checks: the job is another delivery's
	case cause != nil: // the grace period ended during the checks
		s.log.Warn("shutdown before the job ran; handing it back")
		s.unrun(sctx, errors.New("shutdown before the job ran")) // its KV unread, for the next delivery
		return
	}
	start := time.Now()
	s.run = &dispatcher.StageRecord{Stage: l.cfg.Stage, Generation: job.Generation, Worker: l.cfg.Worker.Worker,
		Engine: l.cfg.Worker.Engine, Started: start}
	d := &Delivery{Job: job, Attempt: attempt, loop: l, stopBeats: func() {}, running: r, permit: permit.Token, stop: cancel}
	d.ctx = jctx
	handled = true
	// Admitted: from now on, a redelivery of the job that asks is told
	// this one runs it (see onRunning).
	l.mu.Lock()
	r.admitted = true
	l.mu.Unlock()
	// A first delivery's wait is its queue time; a redelivery's, or a
	// handed-back copy's, would count an earlier attempt too.
	var waited time.Duration
	if attempt == 1 && job.HandBacks == 0 && !stored.IsZero() {
		waited = time.Since(stored)
	}
	l.cfg.Metrics.JobStarted(l.cfg.Stage, waited)
	err = l.handle(jctx, d)
	ls.settle()
	s.run.Ms = float64(time.Since(start).Microseconds()) / 1000
	releaseEngine()
	var took time.Duration
	if f := (*verdict.Failure)(nil); !d.Forwarded() && !(errors.As(err, &f) && f.HandBack) {
		took = time.Since(start) // it reached the engine
	}
	l.cfg.Metrics.JobEnded(l.cfg.Stage, took)
	l.mu.Lock()
	beganBeating := r.beating
	l.mu.Unlock()
	d.stopBeats()
	// A job whose engine never ran it (a decode that waited for its
	// engine, say) counts as not run: a handoff's KV is unread, and is
	// released however the job ends.
	var unread *verdict.Failure
	s.ran = !errors.As(err, &unread) || !unread.Unread
	s.sent = d.sent()

	cause := context.Cause(jctx)
	handedOff := err == nil && d.handoff != nil
	o := outcomeOf(err, cause, handedOff, pullCtx.Err() != nil && jobCtx.Err() != nil)
	stopped = o == verdict.Superseded || o == verdict.Abandoned || o == verdict.Stopped
	if o == verdict.OK {
		l.recordDuration(time.Since(start))
		if l.cfg.Stage == dispatcher.StageDecode && !beganBeating.IsZero() {
			l.keepAnswered(r, beganBeating)
		}
	}
	var failure *verdict.Failure
	errors.As(err, &failure)
	errText := ""
	if err != nil {
		errText = err.Error()
	}
	v := verdict.Decide(verdict.Facts{Stage: l.cfg.Stage, Handoff: len(job.KV) > 0, Sent: s.sent > 0, Ran: s.ran,
		Attempt: attempt, MaxDeliver: l.cfg.MaxDeliver, HandBacks: job.HandBacks < maxHandBacks,
		HandedOff: handedOff, Moved: d.moved != nil, Failure: failure}, o, errText)
	s.carry(sctx, v, d, err, cause, time.Since(start))
}

// handle runs the handler on a delivery. A handler that panics (a job that
// meets a bug) fails that job for good, kept for replay and answered, and
// the worker goes on: a panic would end the process, every stream it runs
// with it, and the job would come back to do the same to the next worker.
func (l *Loop) handle(ctx context.Context, d *Delivery) (err error) {
	defer func() {
		if v := recover(); v != nil {
			l.log.Error("the handler panicked: failing the job", logging.KeyRequestID, d.Job.ID,
				"panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			err = verdict.Permanent(fmt.Errorf("%s handler panicked: %v", l.cfg.Stage, v),
				openai.NewError(http.StatusInternalServerError, "pdq's %s worker failed on this request", l.cfg.Stage))
		}
	}()
	return l.cfg.Handler(ctx, d)
}

// giveBack returns a job that came as the loop stopped, not run.
func (l *Loop) giveBack(ctx context.Context, msg jetstream.Msg) {
	job, err := dispatcher.ParseJob(msg.Headers(), msg.Data())
	if err != nil {
		// Whoever runs it next settles it as unreadable.
		if nerr := msg.Nak(); nerr != nil {
			l.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(nerr))
		}
		return
	}
	attempt, _ := deliveryOf(msg)
	// Storing its copy may retry for a while: the job stays this loop's
	// meanwhile, not redelivered beside its copy.
	defer l.keepAlive(ctx, msg)()
	s := l.settleOf(msg, job, attempt)
	s.unrun(ctx, errors.New("the worker stopped as the job came"))
}

// deliveryOf is which delivery of its job msg is, and when the job was
// stored. A job stored again by a rebuild of its stream (see dispatcher/admin/doctor.go)
// is a first delivery to NATS but may have run before: each of its
// deliveries counts one more than NATS says, so that it is judged as a
// redelivery (see replies for its replies).
func deliveryOf(msg jetstream.Msg) (attempt int, stored time.Time) {
	attempt = 1
	if meta, err := msg.Metadata(); err == nil {
		attempt, stored = int(meta.NumDelivered), meta.Timestamp
	}
	if msg.Headers().Get(dispatcher.HeaderRebuilt) != "" {
		attempt++
	}
	return attempt, stored
}

// rebuiltReplies numbers the replies of a job stored again by a rebuild
// above any delivery its first message can have had: the gateway takes
// them for a restart, not for more of an earlier delivery's answer.
const rebuiltReplies = 128

// unreadable settles a message that is not a job this build can run. It
// is kept in the dead-letter stream, recorded as failed, and its client
// answered when the reply subject could be read.
func (l *Loop) unreadable(ctx context.Context, msg jetstream.Msg, job *dispatcher.Job, err error) {
	l.log.Error("a job this worker cannot read", logging.Err(err), "subject", msg.Subject())
	id := job.ID
	if !dispatcher.ValidRequestID(id) {
		id = "invalid-" + dispatcher.Token()
	}
	derr := l.deadLetter(ctx, msg, id, http.StatusInternalServerError, err.Error())
	if errors.Is(derr, dispatcher.ErrDLQFull) {
		l.log.Error("the dead-letter stream is full: this unreadable job is not kept", logging.Err(derr))
	} else if derr != nil {
		l.log.Error("could not keep an unreadable job in the dead-letter stream; it stays queued", logging.Err(derr))
		if nerr := msg.NakWithDelay(dlqRetry); nerr != nil {
			l.log.Warn("nak failed; the job comes back after the ack wait", logging.Err(nerr))
		}
		return
	}
	if dispatcher.ValidRequestID(job.ID) && job.Generation > 0 {
		if rerr := l.records.End(ctx, job.ID, job.Generation, dispatcher.StateFailed,
			&dispatcher.RecordError{Status: http.StatusInternalServerError, Message: err.Error(), Stage: l.cfg.Stage}); rerr != nil {
			l.log.Warn("could not record the failure", logging.Err(rerr))
		}
	}
	if job.ReplyTo != "" {
		e := openai.NewError(http.StatusInternalServerError, "pdq could not read the job: %v", err)
		if rerr := reply.NewWriter(l.nc, job.ReplyTo, dispatcher.ReplyAttempt(job.Generation, 255)).Error(e); rerr != nil {
			l.log.Warn("could not answer the client of an unreadable job", logging.Err(rerr))
		}
	}
	if terr := msg.TermWithReason(truncate(err.Error(), 256)); terr != nil {
		l.log.Warn("term failed; the job will come back and be dead-lettered again (deduplicated)", logging.Err(terr))
	}
}

// keepAlive tells JetStream the job is still running, every third of the
// ack wait, until stopped.
func (l *Loop) keepAlive(ctx context.Context, msg jetstream.Msg) (stop func()) {
	kctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(l.cfg.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-kctx.Done():
				return
			case <-t.C:
				if err := msg.InProgress(); err != nil {
					l.log.Warn("in-progress signal failed; the job may be redelivered", logging.Err(err))
				}
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}
