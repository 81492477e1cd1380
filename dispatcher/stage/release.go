package stage

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// releaseLoop frees the KV of handoffs that the prefill stage could not
// store (PDQ_DECODE full): every decode worker of the pool takes them, one
// at a time, each in one of the worker's slots, so the engine never gets
// more calls than the slots.
func (l *Loop) releaseLoop(ctx context.Context, slots chan struct{}) {
	pulls := pull.NewPuller(ctx, l.nc, l.js, l.cfg.PullWait)
	defer func() {
		// A release that came as the loop stopped goes back at once.
		for _, msg := range pulls.Stop() {
			_ = msg.Nak() // or it comes back after the ack wait
		}
	}()
	var cons jetstream.Consumer
	for ctx.Err() == nil {
		if cons == nil {
			c, err := dispatcher.EnsureReleaseConsumer(ctx, l.js, l.cfg.Pool, l.cfg.AckWait, l.cfg.MaxDeliver, dispatcher.WithLogger(l.log))
			if err != nil {
				l.log.Warn("no release queue; retrying in 5s", logging.Err(err))
				if sleep.For(ctx, 5*time.Second) != nil {
					return
				}
				continue
			}
			cons = c
		}
		msg, err := pulls.Next(ctx, cons)
		switch {
		case ctx.Err() != nil:
			if err == nil {
				_ = msg.Nak() // pulled as the loop stopped: back at once, not after the ack wait
			}
			return
		case errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrNoMessages):
			continue
		case err != nil:
			l.log.Warn("release pull failed; retrying in 1s", logging.Err(err))
			cons = nil
			if sleep.For(ctx, time.Second) != nil {
				return
			}
			continue
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			_ = msg.Nak() // or it comes back after the ack wait
			return
		}
		if l.cfg.EngineSlots != nil {
			if l.cfg.EngineSlots.Acquire(ctx) != nil {
				<-slots
				_ = msg.Nak() // or it comes back after the ack wait
				return
			}
		}
		l.releaseOne(ctx, msg)
		if l.cfg.EngineSlots != nil {
			l.cfg.EngineSlots.Release()
		}
		<-slots
	}
}

func (l *Loop) releaseOne(ctx context.Context, msg jetstream.Msg) {
	if notYet(msg) {
		return
	}
	job, err := dispatcher.ParseJob(msg.Headers(), msg.Data())
	if err == nil && len(job.KV) == 0 {
		err = fmt.Errorf("release of %s carries no kv_transfer_params", job.ID)
	}
	if err != nil {
		l.log.Warn("dropping an unreadable release", logging.Err(err))
		_ = msg.Term() // nothing to release: a lost term redelivers it, to be dropped again
		return
	}
	s := &settle{l: l, msg: msg, job: job, attempt: 1, delivery: dispatcher.Token(), engineHeld: l.cfg.EngineSlots != nil,
		log: l.log.With(logging.KeyRequestID, job.ID, "generation", job.Generation)}
	// At most once: a release that ran twice would read freed blocks, which
	// with NIXL v1 kills the decode engine; one that never ran only leaves
	// the blocks to their lease. Deleting the message claims it: of two
	// workers holding it (a redelivery), only one delete succeeds.
	// The claim is made whole even if the loop stops meanwhile.
	cctx := context.WithoutCancel(ctx)
	meta, err := msg.Metadata()
	if err == nil {
		var st jetstream.Stream
		if st, err = l.js.Stream(cctx, dispatcher.StreamRelease); err == nil {
			err = st.DeleteMsg(cctx, meta.Sequence.Stream)
		}
	}
	if err != nil {
		s.log.Debug("release not claimed (taken by another worker, or NATS unreachable); leaving it", logging.Err(err))
		return
	}
	if err := msg.Ack(); err != nil {
		s.log.Debug("ack of a claimed release failed; the message is gone all the same", logging.Err(err))
	}
	if job.HandBacks > maxReleaseTries {
		s.log.Warn("could not release the prefill's KV blocks; they stay held until their lease ends", "tries", job.HandBacks)
		return
	}
	s.release(context.WithoutCancel(ctx), "its handoff could not be stored, or its release did not run")
}

// A release whose call the engine did not run is tried again after
// releaseRetry, up to maxReleaseTries times: past the lease (30 s in
// vLLM) release skips it anyway.
const (
	releaseRetry    = time.Second
	maxReleaseTries = 60
)

// headerNotBefore on a release tried again is when it is due, in Unix
// milliseconds: a worker that pulls it sooner puts it back until then,
// without claiming it.
const headerNotBefore = "Pdq-Not-Before"

// notYet puts back a release that is not due, and reports whether it did.
func notYet(msg jetstream.Msg) bool {
	ms, err := strconv.ParseInt(msg.Headers().Get(headerNotBefore), 10, 64)
	if err != nil {
		return false
	}
	wait := time.Until(time.UnixMilli(ms))
	if wait <= 0 {
		return false
	}
	if err := msg.NakWithDelay(wait); err != nil {
		return false // run it now rather than wait out the ack wait
	}
	return true
}

// releaseNow releases a handoff's KV that a prefill worker asks this
// decode worker to release directly, the release queue having refused
// it, and answers once done (a Pdq-Status of 500 if the release failed).
func (l *Loop) releaseNow(ctx context.Context, m *nats.Msg) {
	job, err := dispatcher.ParseJob(m.Header, m.Data)
	if err == nil && len(job.KV) == 0 {
		err = fmt.Errorf("release of %s carries no kv_transfer_params", job.ID)
	}
	reply := nats.NewMsg(m.Reply)
	if err != nil {
		l.log.Warn("dropping an unreadable release", logging.Err(err))
		reply.Header[dispatcher.HeaderStatus] = []string{"400"}
		_ = m.RespondMsg(reply) // the asker gives up on its own
		return
	}
	s := &settle{l: l, job: job, attempt: 1, delivery: dispatcher.Token(), direct: true, log: l.log.With(logging.KeyRequestID, job.ID, "generation", job.Generation)}
	if !s.release(ctx, "its handoff and its release could not be stored") {
		reply.Header[dispatcher.HeaderStatus] = []string{"500"}
	}
	_ = m.RespondMsg(reply) // a lost answer only costs the asker a log line
}
