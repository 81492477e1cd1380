package stage

import (
	"context"
	"encoding/json"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
)

// maxHandBacks bounds how often one job is handed back, should every
// worker keep handing it on.
const maxHandBacks = 8

// Handler runs one job of a stage. A nil error acks the job; see
// [verdict.Failure] for the rest. The handler must return when ctx ends.
type Handler func(ctx context.Context, d *Delivery) error

// Delivery is one delivery of a job to a handler.
type Delivery struct {
	Job *dispatcher.Job
	// Attempt counts deliveries of this job in its generation, from 1.
	Attempt int
	loop    *Loop
	replies *reply.Writer
	handoff *dispatcher.Job
	moved   *dispatcher.Job
	// movedFrom is the engine's failure that made the handler migrate.
	movedFrom error
	// ctx and stopBeats run a decode's heartbeats from its first use of
	// Replies to the handler's return.
	ctx       context.Context
	stopBeats func()
	// running is the delivery's entry in the loop's running jobs (nil in
	// tests), marked beating while its beats run.
	running *runningJob
	permit  uint64
	// stop ends the job's context, as a cancel broadcast does.
	stop context.CancelCauseFunc
}

// Permit is the token of the permit Config.Ready granted this
// delivery's pull (0 without Ready).
func (d *Delivery) Permit() uint64 { return d.permit }

// Migrate is how a decode handler that failed after output hands the rest
// of the answer on: sent is the text the client has been sent, all
// generations together, from which the next decode continues the
// client's body; resume says what else the client has, and cause is the
// engine's failure. The loop queues it as the next generation, on any
// decode engine, before it acks this job. The handler must have sent
// Moved on its reply first.
func (d *Delivery) Migrate(sent []byte, resume dispatcher.Resume, cause error) {
	d.movedFrom = cause
	next := *d.Job
	resume.Original = true
	next.Sent, next.KV, next.Prefill, next.Resume = sent, nil, nil, &resume
	next.Generation = d.Job.Generation + 1
	// A new job: the hand-backs of the one it continues do not count
	// against its own (a worker hands on a continuation from the engine
	// it broke on a bounded number of times).
	next.HandBacks = 0
	d.moved = &next
}

// HandOff is how a prefill handler returns its result: the job for the
// decode stage, with kv, which the loop stores before it acks the prefill.
// A failed store is retried as a store; the prefill is never run again
// for it.
func (d *Delivery) HandOff(kv json.RawMessage, rec dispatcher.StageRecord) {
	h := *d.Job
	h.KV, h.Prefill = kv, &rec
	d.handoff = &h
}

// Forward sends the job on to the decode stage without a prefill: the
// decode engine prefills the prompt itself. It is the fallback of a
// prefill worker whose engine is down while no other is healthy.
func (d *Delivery) Forward() {
	h := *d.Job
	h.KV, h.Prefill = nil, nil
	d.handoff = &h
}

// Forwarded reports whether Forward was called.
func (d *Delivery) Forwarded() bool {
	return d.handoff != nil && len(d.handoff.KV) == 0 && d.handoff.Prefill == nil
}

// Moved reports whether Migrate was called.
func (d *Delivery) Moved() bool { return d.moved != nil }

// MovedFrom is the failure a migrated delivery moved away from.
func (d *Delivery) MovedFrom() error { return d.movedFrom }

// Replies writes the client's reply for this delivery. A decode's first
// call starts its heartbeats: from then on the gateway knows the decode
// runs, and which chunks it lacks, even while the engine is silent.
func (d *Delivery) Replies() *reply.Writer {
	if d.replies == nil {
		d.replies = d.loop.replies(d.Job, d.Attempt)
		if d.loop.cfg.Stage == dispatcher.StageDecode && d.ctx != nil {
			d.replies.Watch(d.stop, d.loop.wanted(d.Job))
			if d.Job.ReplyStart {
				d.replies.BeatAtOnce() // the gateway's fair queue waits for it
			}
			// The gateway that stops hearing from a decode asks whether it
			// still beats (dispatcher.DecodeBeating): once its handler
			// returns, the job has ended, or waits in the queue again
			// (handed back, retried), and silence is no longer a running
			// decode's. Marked before the first beat, so that a decode the
			// gateway heard counts as beating since before it was heard.
			d.loop.setBeating(d.running, time.Now())
			stop := d.replies.Beats(d.ctx, beatEvery(d.loop.cfg.StallTimeout))
			d.stopBeats = func() {
				d.loop.setBeating(d.running, time.Time{})
				stop()
			}
		}
	}
	return d.replies
}

// sent is the number of chunks this delivery sent to the client.
func (d *Delivery) sent() int {
	if d.replies == nil {
		return 0
	}
	return d.replies.Own()
}

// replies writes job's reply. Decode deliveries are ordered by generation
// and delivery, so a later one starts a new reply; prefill errors are
// delivery 0 of their generation.
func (l *Loop) replies(job *dispatcher.Job, attempt int) *reply.Writer {
	if job.Rebuilt {
		attempt += rebuiltReplies
	}
	if l.cfg.Stage != dispatcher.StageDecode {
		attempt = 0
	}
	w := reply.NewWriter(l.nc, job.ReplyTo, dispatcher.ReplyAttempt(job.Generation, attempt))
	if job.ReplyFramed {
		w.Frame()
		w.Local(l.cfg.LocalReplies)
	}
	if job.Resume != nil && l.cfg.Stage == dispatcher.StageDecode {
		w.ContinueAt(job.Resume.Chunks)
	}
	w.SetEndWait(min(l.cfg.StallTimeout, reply.DefaultEndWait))
	return w
}

// beatEvery is how often a running decode beats to its gateway: five times
// within the stall time-out, so a few lost beats do not fail a request.
func beatEvery(stall time.Duration) time.Duration {
	return min(max(stall/5, 100*time.Millisecond), 2*time.Second)
}
