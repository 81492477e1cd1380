package stage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// settle decides what becomes of one delivery: whether it may run, and
// after it ran, ack, retry, a new generation, or its end. Every way out
// answers the client exactly once, or leaves the job queued for a later
// delivery that will.
type settle struct {
	l       *Loop
	msg     jetstream.Msg
	job     *dispatcher.Job
	attempt int
	log     *slog.Logger
	// sent is the number of chunks the handler sent to the client.
	sent int
	// ran is set once the handler ran: a decode engine may have read the
	// handoff's KV. kvSpent is set once the KV was read, or released.
	ran, kvSpent bool
	// engineHeld is set while the job holds one of the engine's shared
	// slots (Config.EngineSlots): a KV release takes one otherwise.
	engineHeld bool
	// direct is set on a release asked of this worker directly (the
	// release queue refused it): one that does not run is not queued.
	direct bool
	// delivery names this delivery, in running queries and as the reader
	// of a handoff's KV claim (dispatcher/kvread.go); kvClaimed is set while it holds
	// the claim.
	delivery  string
	kvClaimed bool
	// run is this delivery's engine call, once the handler started: a
	// request that ends here keeps it in its record, beside its prefill's.
	run *dispatcher.StageRecord
}

// stages are the stage runs that led to where the request is: its
// prefill's (on a handoff) and this delivery's.
func (s *settle) stages() []dispatcher.StageRecord {
	var out []dispatcher.StageRecord
	if s.job.Prefill != nil && s.l.cfg.Stage == dispatcher.StageDecode {
		out = append(out, *s.job.Prefill)
	}
	if s.run != nil {
		out = append(out, *s.run)
	}
	return out
}

// settleOf settles a delivery of job, its attempt-th, logging with the
// request's id, generation and attempt.
func (l *Loop) settleOf(msg jetstream.Msg, job *dispatcher.Job, attempt int) *settle {
	return &settle{l: l, msg: msg, job: job, attempt: attempt, delivery: dispatcher.Token(),
		log: l.log.With(logging.KeyRequestID, job.ID, "generation", job.Generation, "attempt", attempt)}
}

// rebuilt reports whether the job was stored again by a rebuild of its
// stream (dispatcher/admin/doctor.go).
func (s *settle) rebuilt() bool { return s.msg.Headers().Get(dispatcher.HeaderRebuilt) != "" }

// admit checks a delivery before any engine call. It settles, and returns
// false for, a job that must not run: its request ended or moved on to a
// later generation, its deadline passed, its gateway is gone, its
// deliveries are used up, or its handoff's KV may be gone.
func (s *settle) admit(ctx context.Context) bool {
	l, job := s.l, s.job
	handoff := l.cfg.Stage == dispatcher.StageDecode && len(job.KV) > 0
	rec, _, err := l.records.GetChanged(ctx, job.ID, job.RecordRevision)
	switch {
	case err == nil && rec == nil:
		// Unchanged since this generation was queued.
	case err == nil && rec.Generation > job.Generation:
		s.drop(ctx, fmt.Sprintf("superseded by generation %d", rec.Generation))
		return false
	case err == nil && rec.State.Ended():
		s.drop(ctx, "request already "+string(rec.State))
		return false
	case err == nil && rec.Gateway != job.GatewayID():
		// The id was taken over by a client's retry at another gateway, or
		// by a replay: this job is the earlier request's.
		s.drop(ctx, "the request id was taken over by a retry or a replay")
		return false
	case err != nil && !errors.Is(err, dispatcher.ErrNoRecord):
		// Not knowing the record is no reason to stop: run the job.
		s.log.Warn("could not read the request record; running the job", logging.Err(err))
	}
	if job.Expired(time.Now().Add(minUsefulTime)) {
		s.expired(ctx)
		return false
	}
	if !l.liveness.Alive(ctx, job.GatewayID()) {
		s.end(ctx, dispatcher.StateCancelled, &dispatcher.RecordError{Status: 499, Message: errGatewayGone.Error(), Stage: l.cfg.Stage})
		s.answer(gatewayGoneError()) // heard by nobody, unless the gateway was only unreachable
		s.drop(ctx, errGatewayGone.Error())
		return false
	}
	if l.cfg.Stage == dispatcher.StagePrefill && s.attempt > 1 && s.handedOff(ctx) {
		// An earlier delivery stored its handoff but was not acked: the
		// prefill is done, and running it again would hold KV nobody reads.
		s.log.Info("prefill job redelivered after its handoff was stored; acking it")
		if err := s.msg.DoubleAck(ctx); err != nil {
			s.log.Warn("ack failed; the job will be redelivered and acked again", logging.Err(err))
		}
		return false
	}
	// A handoff stored again by a rebuild (its attempt counted as 2, see
	// deliveryOf) was read by an earlier delivery only if that one claimed
	// its KV: the claims' bucket is rebuilt first, and kept.
	redelivered := s.attempt > 1 && !(handoff && s.rebuilt())
	if handoff && !redelivered && !s.claimKV(ctx) {
		// NATS delivered it as a first delivery, but an earlier one has
		// claimed its KV: a restarted server forgot that delivery, or its
		// ack came late. It may have read the KV.
		l.cfg.Metrics.retry(l.cfg.Stage, "kv_claimed")
		s.log.Info("handoff delivered again after an earlier delivery claimed its KV")
		redelivered = true
	}
	if redelivered && l.runningElsewhere(ctx, job, s.attempt, s.delivery) {
		// Redelivered while its first delivery still runs: that worker was
		// cut off from NATS for longer than the ack wait, but its engine
		// call went on. Running it twice would read a handoff's KV twice
		// or start a second answer; the first settles it, and this copy
		// comes back only if the first never does.
		l.cfg.Metrics.retry(l.cfg.Stage, "running_elsewhere")
		s.log.Info("job redelivered while an earlier delivery still runs; leaving it to that one")
		if err := s.msg.NakWithDelay(l.cfg.AckWait); err != nil {
			s.log.Warn("nak failed; the job comes back after the ack wait", logging.Err(err))
		}
		return false
	}
	if s.attempt > l.cfg.MaxDeliver {
		e := openai.NewError(http.StatusBadGateway, "%s failed: no worker finished it in %d deliveries", l.cfg.Stage, l.cfg.MaxDeliver)
		s.failForGood(ctx, e, fmt.Errorf("deliveries used up (%d)", s.attempt-1), true)
		return false
	}
	if handoff && redelivered {
		// An earlier delivery may have read the KV blocks, which a prefill
		// engine serves once.
		s.regenerate(ctx, verdict.WasteRedelivered, "a redelivered handoff's KV may have been read", false)
		return false
	}
	if handoff && job.Prefill != nil && time.Since(job.Prefill.Ended()) > l.cfg.KVTTL {
		s.regenerate(ctx, verdict.WasteKVTTL, fmt.Sprintf("the handoff is older than the KV TTL (%s)", l.cfg.KVTTL), true)
		return false
	}
	return true
}

// handedOff reports whether this generation's handoff is in the decode
// stream: waiting, or being decoded (a work queue keeps a message until it
// is acked). Once decoded and acked, the gateway records the request done
// and admit drops the job before this; in the moment between the two, the
// prefill runs again and its KV is left to its lease.
func (s *settle) handedOff(ctx context.Context) bool {
	st, err := s.l.js.Stream(ctx, dispatcher.StreamDecode)
	if err != nil {
		return false
	}
	// Stored for any worker, or preferring a decode engine.
	for _, subject := range dispatcher.JobSubjects(dispatcher.StageDecode, s.job.Pool, s.job.ID) {
		m, err := st.GetLastMsgForSubject(ctx, subject)
		if err == nil && m.Header.Get(dispatcher.HeaderGeneration) == strconv.Itoa(s.job.Generation) {
			return true
		}
	}
	return false
}

// gatewayGoneError is what a job stopped for its gateway's silence
// answers, in case the gateway was only unreachable for a while: an error,
// rather than a client left waiting.
func gatewayGoneError() *openai.Error {
	return openai.NewError(http.StatusServiceUnavailable, "pdq lost touch with this request's gateway and stopped it; retry it")
}

// stopped settles a job stopped by its client or its gateway's end.
func (s *settle) stopped(ctx context.Context, cause error) {
	s.log.Debug("job stopped: " + cause.Error())
	s.end(ctx, dispatcher.StateCancelled, &dispatcher.RecordError{Status: 499, Message: cause.Error(), Stage: s.l.cfg.Stage})
	if errors.Is(cause, errGatewayGone) {
		s.answer(gatewayGoneError()) // heard by nobody, unless the gateway was only unreachable
	}
	if !s.ran {
		s.drop(ctx, cause.Error())
		return
	}
	s.term(cause.Error())
}

// expired settles a job whose request's deadline has passed: before it
// ran (or with too little time left to run), or while it ran, its engine
// call cut off. The client gets a 504 (the gateway gives the same at the
// same deadline); a replay's record says so.
func (s *settle) expired(ctx context.Context) {
	what := "before a " + string(s.l.cfg.Stage) + " worker was free"
	if s.ran {
		what = "while its " + string(s.l.cfg.Stage) + " ran"
	}
	e := openai.NewError(http.StatusGatewayTimeout, "the request's deadline passed %s", what)
	s.end(ctx, dispatcher.StateExpired, &dispatcher.RecordError{Status: e.Status(), Message: e.Message, Stage: s.l.cfg.Stage})
	s.answer(e)
	if !s.ran {
		s.drop(ctx, "deadline passed")
		return
	}
	s.log.Debug("job stopped: " + e.Message)
	s.term("deadline passed")
}

// succeeded acks a job that ran; a prefill's handoff is stored first.
func (s *settle) succeeded(ctx context.Context, d *Delivery, took time.Duration) {
	if d.handoff != nil {
		m := s.fitHandoff(d) // may send it on decode-only, as d.handoff
		if err := s.storeHandoff(ctx, m, d.handoff); err != nil {
			s.log.Warn("could not queue the handoff; the request fails without a new prefill", logging.Err(err))
			status := http.StatusServiceUnavailable
			if errors.Is(err, dispatcher.ErrQueueFull) {
				status = http.StatusTooManyRequests
			}
			if errors.Is(err, dispatcher.ErrQueueFull) || errors.Is(err, dispatcher.ErrNotStoring) {
				// A full stream refused it outright (it checks for a
				// duplicate first), or one that does not store failed to:
				// nothing was stored, so nothing else will read or release
				// the KV. After any other error the handoff may have been
				// stored, and is left to its decode or lease.
				s.queueRelease(ctx, d.handoff)
			}
			e := openai.NewError(status, "could not queue the decode stage: %v", err)
			s.end(ctx, dispatcher.StateFailed, &dispatcher.RecordError{Status: status, Message: e.Message, Stage: dispatcher.StagePrefill})
			s.answer(e)
			s.term("handoff not stored")
			return
		}
	}
	if s.job.ReplyTo == "" && d.replies != nil && s.l.cfg.Stage == dispatcher.StageDecode {
		if err := s.keepResult(ctx, d.replies); err != nil {
			// The answer exists only in the record: without it the job
			// must run again.
			s.log.Error("could not keep the replay's result in its record; running it again", logging.Err(err))
			if nerr := s.msg.NakWithDelay(time.Second); nerr != nil {
				s.log.Warn("nak failed; the job comes back after the ack wait", logging.Err(nerr))
			}
			return
		}
	}
	// A plain ack, not one JetStream confirms: every job succeeds through
	// here, and waiting for the confirmation cost a round trip and two
	// messages each time, while a failed confirmation changed nothing. A
	// lost ack brings the job back after the ack wait, and admit settles
	// it then without running it: a prefill whose handoff is stored is
	// acked, a job whose request has ended is dropped.
	//
	// Not a prompt of a batch, whose record ends with the whole batch's:
	// brought back while another prompt still runs, it would run again,
	// for nobody. Its ack is confirmed, and sent again if the
	// confirmation does not come.
	if s.job.BatchPrompt {
		s.confirmAck(ctx)
	} else if err := s.msg.Ack(); err != nil {
		s.log.Warn("ack failed; the job will be redelivered and dropped", logging.Err(err))
	}
	s.log.Debug("job done", logging.Ms("duration_ms", took))
}

// confirmAck acks the job with JetStream's confirmation, sent again (up
// to three times in all) while no answer comes: an ack that landed is
// confirmed again, a refusal is final.
func (s *settle) confirmAck(ctx context.Context) {
	var err error
	for try := range 3 {
		if try > 0 && sleep.For(ctx, 100*time.Millisecond) != nil {
			break
		}
		actx, cancel := context.WithTimeout(ctx, reply.AckTimeout)
		err = s.msg.DoubleAck(actx)
		cancel()
		if err == nil || !dispatcher.NoAnswer(err) {
			break
		}
	}
	if err != nil {
		s.l.cfg.Metrics.retry(s.l.cfg.Stage, "ack_unconfirmed")
		s.log.Warn("ack unconfirmed; this prompt of a batch may run again if the ack was lost", logging.Err(err))
	}
}

// carry carries out v, the verdict on delivery d, whose handler
// returned err with its job context's cause; took is how long it ran.
func (s *settle) carry(ctx context.Context, v verdict.Verdict, d *Delivery, err, cause error, took time.Duration) {
	if v.Note != "" {
		s.log.Warn(v.Note, logging.Err(err))
	}
	switch v.Act {
	case verdict.ActAck:
		s.succeeded(ctx, d, took)
	case verdict.ActMigrate:
		s.migrate(ctx, d.moved)
	case verdict.ActStop, verdict.ActExpire:
		if v.Release {
			s.queueRelease(ctx, d.handoff)
		}
		if v.Act == verdict.ActExpire {
			s.expired(ctx)
		} else {
			s.stopped(ctx, cause)
		}
	case verdict.ActNothing:
		if v.Release {
			s.queueRelease(ctx, d.handoff)
		}
		s.log.Debug("job stopped: a later attempt of the request runs")
	case verdict.ActFail:
		if v.Release {
			s.ran = false
			s.release(ctx, "the decode engine refused the request")
		}
		if v.Why != "" {
			err = fmt.Errorf("%s: %w", v.Why, err)
		}
		s.failForGood(ctx, v.Client, err, v.Answer)
	case verdict.ActHandBack:
		s.handBack(ctx, err)
	case verdict.ActRegenerate:
		s.regenerate(ctx, v.Waste, v.Why, v.Release)
	case verdict.ActRetry:
		s.l.cfg.Metrics.retry(s.l.cfg.Stage, "retry")
		delay := retryDelay(s.l.cfg.RetryBase, s.attempt)
		s.log.Warn("job failed; retrying", logging.Err(err), "retry_in", delay.String())
		if err := s.msg.NakWithDelay(delay); err != nil {
			s.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
		}
	case verdict.ActUnrun:
		s.unrun(ctx, fmt.Errorf("%s: %w", v.Why, err))
	case verdict.ActNak:
		s.log.Warn("job interrupted by shutdown; handing it back", logging.Err(err))
		if err := s.msg.Nak(); err != nil {
			s.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
		}
	}
}

// unrun gives back a job this worker will not run. A first delivery goes
// back as a new copy, which another worker takes as it is: its handoff's
// KV unread, while its hand-backs last. A redelivery goes back as it is,
// keeping its count, and admit judges it again.
func (s *settle) unrun(ctx context.Context, why error) {
	if s.attempt == 1 && s.job.HandBacks < maxHandBacks {
		s.handBack(ctx, why)
		return
	}
	s.unclaimKV(ctx)
	if err := s.msg.Nak(); err != nil {
		s.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
	}
}

// failForGood ends the request: the job goes to the dead-letter stream when
// it can be replayed, the record says why it failed, and only then is the
// client answered (when answer is set) and the job removed from the queue.
// A client's own error (a 4xx) is recorded, not dead-lettered. When the
// dead letter cannot be stored, nothing is answered yet: the job stays
// queued, and a later delivery fails it again.
func (s *settle) failForGood(ctx context.Context, client *openai.Error, cause error, answer bool) {
	status := client.Status()
	clientsFault := status >= 400 && status < 500 && status != http.StatusTooManyRequests && status != 499
	if clientsFault {
		s.log.Info("request refused by the engine", "status", status, logging.Err(cause))
	} else {
		s.log.Error("request failed for good", "status", status, logging.Err(cause))
		switch err := s.l.deadLetter(ctx, s.msg, s.job.ID, status, cause.Error()); {
		case errors.Is(err, dispatcher.ErrDLQFull):
			// A full DLQ refuses the entry rather than dropping older
			// ones; the client is answered all the same.
			s.log.Error("the dead-letter stream is full: this failure is not kept for replay", logging.Err(err))
		case err != nil:
			s.log.Error("could not store the dead letter; the job stays queued until it can be", logging.Err(err))
			if nerr := s.msg.NakWithDelay(dlqRetry); nerr != nil {
				s.log.Warn("nak failed; the job comes back after the ack wait", logging.Err(nerr))
			}
			return
		}
	}
	s.end(ctx, dispatcher.StateFailed, &dispatcher.RecordError{Status: status, Message: client.Message, Stage: s.l.cfg.Stage})
	if answer {
		s.answer(client)
	}
	s.term(client.Message)
}

// drop removes a job that must not run, releasing its handoff's KV if no
// decode engine can have read it.
func (s *settle) drop(ctx context.Context, why string) {
	s.log.Debug("job dropped: " + why)
	if s.l.cfg.Stage == dispatcher.StageDecode && (s.attempt == 1 || s.rebuilt()) {
		s.release(ctx, why) // a rebuilt one's only if unclaimed: see release
	}
	s.term(why)
}

// answer sends the client an error, if it has a reply subject. The wait
// for the gateway's ack does not hold the slot: the request's end is
// recorded already, and a gateway that never hears the error finds it in
// the record.
func (s *settle) answer(e *openai.Error) {
	if s.job.ReplyTo == "" {
		return
	}
	w := s.l.replies(s.job, s.attempt)
	go func() {
		if err := w.Error(e); err != nil {
			s.log.Warn("could not send the error to the gateway", logging.Err(err))
		}
	}()
}

// end records the request's end.
func (s *settle) end(ctx context.Context, state dispatcher.State, e *dispatcher.RecordError) {
	if err := s.l.records.End(ctx, s.job.ID, s.job.Generation, state, e, s.stages()...); err != nil {
		s.log.Warn("could not record the request's end", "state", string(state), logging.Err(err))
	}
}

func (s *settle) term(reason string) {
	if err := s.msg.TermWithReason(truncate(reason, 256)); err != nil {
		s.log.Warn("term failed; the job will be redelivered and dropped", logging.Err(err))
	}
}
