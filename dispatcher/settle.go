package dispatcher

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// settle decides what becomes of one delivery: whether it may run, and
// after it ran, ack, retry, a new generation, or its end. Every way out
// answers the client exactly once, or leaves the job queued for a later
// delivery that will.
type settle struct {
	l       *StageLoop
	msg     jetstream.Msg
	job     *Job
	attempt int
	log     *slog.Logger
	// sent is the number of chunks the handler sent to the client.
	sent int
	// ran is set once the handler ran: a decode engine may have read the
	// handoff's KV. kvSpent is set once the KV was read, or released.
	ran, kvSpent bool
	// engineHeld is set while the job holds one of the engine's shared
	// slots (StageConfig.EngineSlots): a KV release takes one otherwise.
	engineHeld bool
	// direct is set on a release asked of this worker directly (the
	// release queue refused it): one that does not run is not queued.
	direct bool
	// delivery names this delivery, in running queries and as the reader
	// of a handoff's KV claim (kvread.go); kvClaimed is set while it holds
	// the claim.
	delivery  string
	kvClaimed bool
	// run is this delivery's engine call, once the handler started: a
	// request that ends here keeps it in its record, beside its prefill's.
	run *StageRecord
}

// stages are the stage runs that led to where the request is: its
// prefill's (on a handoff) and this delivery's.
func (s *settle) stages() []StageRecord {
	var out []StageRecord
	if s.job.Prefill != nil && s.l.cfg.Stage == StageDecode {
		out = append(out, *s.job.Prefill)
	}
	if s.run != nil {
		out = append(out, *s.run)
	}
	return out
}

// settleOf settles a delivery of job, its attempt-th, logging with the
// request's id, generation and attempt.
func (l *StageLoop) settleOf(msg jetstream.Msg, job *Job, attempt int) *settle {
	return &settle{l: l, msg: msg, job: job, attempt: attempt, delivery: randomID(),
		log: l.log.With(logging.KeyRequestID, job.ID, "generation", job.Generation, "attempt", attempt)}
}

// rebuilt reports whether the job was stored again by a rebuild of its
// stream (doctor.go).
func (s *settle) rebuilt() bool { return s.msg.Headers().Get(HeaderRebuilt) != "" }

// admit checks a delivery before any engine call. It settles, and returns
// false for, a job that must not run: its request ended or moved on to a
// later generation, its deadline passed, its gateway is gone, its
// deliveries are used up, or its handoff's KV may be gone.
func (s *settle) admit(ctx context.Context) bool {
	l, job := s.l, s.job
	handoff := l.cfg.Stage == StageDecode && len(job.KV) > 0
	rec, _, err := l.records.getChanged(ctx, job.ID, job.RecordRevision)
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
	case err != nil && !errors.Is(err, ErrNoRecord):
		// Not knowing the record is no reason to stop: run the job.
		s.log.Warn("could not read the request record; running the job", logging.Err(err))
	}
	if job.Expired(time.Now().Add(minUsefulTime)) {
		s.expired(ctx)
		return false
	}
	if !l.liveness.Alive(ctx, job.GatewayID()) {
		s.end(ctx, StateCancelled, &RecordError{Status: 499, Message: errGatewayGone.Error(), Stage: l.cfg.Stage})
		s.answer(gatewayGoneError()) // heard by nobody, unless the gateway was only unreachable
		s.drop(ctx, errGatewayGone.Error())
		return false
	}
	if l.cfg.Stage == StagePrefill && s.attempt > 1 && s.handedOff(ctx) {
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
		s.regenerate(ctx, wasteRedelivered, "a redelivered handoff's KV may have been read", false)
		return false
	}
	if handoff && job.Prefill != nil && time.Since(job.Prefill.Ended()) > l.cfg.KVTTL {
		s.regenerate(ctx, wasteKVTTL, fmt.Sprintf("the handoff is older than the KV TTL (%s)", l.cfg.KVTTL), true)
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
	st, err := s.l.js.Stream(ctx, StreamDecode)
	if err != nil {
		return false
	}
	m, err := st.GetLastMsgForSubject(ctx, JobSubject(StageDecode, s.job.Pool, s.job.ID))
	return err == nil && m.Header.Get(HeaderGeneration) == strconv.Itoa(s.job.Generation)
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
	s.end(ctx, StateCancelled, &RecordError{Status: 499, Message: cause.Error(), Stage: s.l.cfg.Stage})
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
	s.end(ctx, StateExpired, &RecordError{Status: e.Status(), Message: e.Message, Stage: s.l.cfg.Stage})
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
	if d.moved != nil {
		s.migrate(ctx, d.moved)
		return
	}
	if d.handoff != nil {
		m := s.fitHandoff(d) // may send it on decode-only, as d.handoff
		if err := s.storeHandoff(ctx, m, d.handoff); err != nil {
			s.log.Warn("could not queue the handoff; the request fails without a new prefill", logging.Err(err))
			status := http.StatusServiceUnavailable
			if errors.Is(err, ErrQueueFull) {
				status = http.StatusTooManyRequests
			}
			if errors.Is(err, ErrQueueFull) || errors.Is(err, ErrNotStoring) {
				// A full stream refused it outright (it checks for a
				// duplicate first), or one that does not store failed to:
				// nothing was stored, so nothing else will read or release
				// the KV. After any other error the handoff may have been
				// stored, and is left to its decode or lease.
				s.queueRelease(ctx, d.handoff)
			}
			e := openai.NewError(status, "could not queue the decode stage: %v", err)
			s.end(ctx, StateFailed, &RecordError{Status: status, Message: e.Message, Stage: StagePrefill})
			s.answer(e)
			s.term("handoff not stored")
			return
		}
	}
	if s.job.ReplyTo == "" && d.replies != nil && s.l.cfg.Stage == StageDecode {
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
		if try > 0 && sleepCtx(ctx, 100*time.Millisecond) != nil {
			break
		}
		actx, cancel := context.WithTimeout(ctx, ackTimeout)
		err = s.msg.DoubleAck(actx)
		cancel()
		if err == nil || !noAnswer(err) {
			break
		}
	}
	if err != nil {
		s.l.cfg.Metrics.retry(s.l.cfg.Stage, "ack_unconfirmed")
		s.log.Warn("ack unconfirmed; this prompt of a batch may run again if the ack was lost", logging.Err(err))
	}
}

// storeHandoff publishes a prefill's result, retrying the publish (never
// the prefill) with back-off for up to 10 s. A duplicate may be this
// handoff, a try whose answer was lost, or that of an earlier run of this
// prefill (a restarted nats-server forgot its delivery, or its ack came
// late): then this run's KV has no reader, and is released.
func (s *settle) storeHandoff(ctx context.Context, m *nats.Msg, h *Job) error {
	seq, dup, err := s.publishRetry(ctx, m, "handoff")
	if err != nil || !dup || len(h.KV) == 0 || s.storedIsThis(ctx, seq, h) {
		return err
	}
	s.log.Info("the prefill ran again after its handoff was stored; releasing this run's KV")
	s.queueRelease(ctx, h)
	return nil
}

// storedIsThis reports whether the decode stream's message seq is the
// handoff h, with h's params. A message already decoded and gone is taken
// as another's: a release of KV a decode has read is not made (its claim
// is taken, see kvread.go). Not knowing (NATS did not answer), it is taken
// as this one: the KV is left to its lease rather than released under a
// decode.
func (s *settle) storedIsThis(ctx context.Context, seq uint64, h *Job) bool {
	st, err := s.l.js.Stream(ctx, StreamDecode)
	if err != nil {
		return true
	}
	raw, err := st.GetMsg(ctx, seq)
	if err != nil {
		return !errors.Is(err, jetstream.ErrMsgNotFound)
	}
	stored, err := ParseJob(raw.Header, raw.Data)
	return err == nil && bytes.Equal(stored.KV, h.KV)
}

// fitHandoff is the message of the delivery's handoff, or, when that is
// larger than the server takes, of the job sent on decode-only: the body
// alone fits (the gateway bounds it), and the decode engine prefills the
// prompt itself, rather than the request failing. That takes a prompt of
// millions of tokens: with the gateway's 7 MiB bound on bodies and 8 MiB
// messages, params over 1 MiB, some 150,000 block ids. Its KV is left to
// the prefill engine's lease: no message can carry it to a decode worker
// to release.
func (s *settle) fitHandoff(d *Delivery) *nats.Msg {
	m := d.handoff.Msg(StageDecode)
	// With room to spare for the headers a dead letter adds: a handoff
	// that fits, but whose dead letter would not, could never fail.
	maxPayload := s.l.nc.MaxPayload()
	if len(d.handoff.KV) == 0 || maxPayload <= 4<<10 || int64(msgSize(m)) <= maxPayload-4<<10 {
		return m
	}
	s.log.Warn("the handoff is larger than a NATS message: sent decode-only, its KV left to the prefill engine's lease",
		"body_bytes", len(d.handoff.Body), "kv_bytes", len(d.handoff.KV), "max_payload", maxPayload)
	s.l.cfg.Metrics.DecodeOnly("handoff_too_large")
	d.Forward()
	return d.handoff.Msg(StageDecode)
}

// msgSize is a message's size as the server counts it against its
// max_payload: the payload and the encoded headers.
func msgSize(m *nats.Msg) int {
	n := len(m.Data) + len("NATS/1.0\r\n\r\n")
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(": \r\n") + len(v)
		}
	}
	return n
}

// queueRelease hands a handoff that could not be stored to the decode
// pool's release queue, so that a decode worker frees its KV.
func (s *settle) queueRelease(ctx context.Context, h *Job) {
	m := h.Msg(StageDecode)
	m.Subject = ReleaseSubject(h.Pool, h.ID)
	// One release per generation; a release tried again (its call did
	// not run) is a copy of its own, counted in its hand-backs.
	// Keyed by the KV too: two runs of one prefill each have their own.
	m.Header[nats.MsgIdHdr] = []string{h.ID + "/r" + strconv.Itoa(h.Generation) + "." + strconv.Itoa(h.HandBacks) + "." + kvReadKey(h)[:8]}
	if h.HandBacks > 0 {
		m.Header[headerNotBefore] = []string{strconv.FormatInt(time.Now().Add(releaseRetry).UnixMilli(), 10)}
	}
	if err := publish(ctx, s.l.js, m); err != nil && !errors.Is(err, ErrDuplicate) {
		// The store refuses it too (a full disk): ask a decode worker of
		// the pool to release it now, at most once.
		s.log.Warn("could not queue the release of the prefill's KV; asking a decode worker directly", logging.Err(err))
		m.Subject = ReleaseNowSubject(h.Pool)
		delete(m.Header, nats.MsgIdHdr)
		delete(m.Header, headerNotBefore)
		go func() {
			resp, err := s.l.nc.RequestMsg(m, releaseNowWait)
			if err == nil && resp.Header.Get(HeaderStatus) != "" {
				err = fmt.Errorf("the decode worker answered %s", resp.Header.Get(HeaderStatus))
			}
			if err != nil {
				s.log.Warn("could not release the prefill's KV; it stays held until its lease ends", logging.Err(err))
			}
		}()
	}
}

// releaseNowWait bounds the wait for a decode worker's direct release: a
// free engine slot, then a one-token call.
const releaseNowWait = 40 * time.Second

// publishRetry stores msg, retrying with back-off for up to 10 s, and
// returns its stream sequence. A duplicate is an earlier try whose ack was
// lost: stored.
func (s *settle) publishRetry(ctx context.Context, msg *nats.Msg, what string) (seq uint64, dup bool, err error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 10*time.Second
	err = backoff.RetryNotify(func() error {
		var err error
		seq, err = publishSeq(ctx, s.l.js, msg)
		switch {
		case errors.Is(err, ErrDuplicate):
			dup = true
			return nil
		case errors.Is(err, ErrNotStoring):
			return backoff.Permanent(err) // until the stream is rebuilt
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		s.log.Warn(what+" publish failed; retrying", logging.Err(err), "retry_in", next.Round(time.Millisecond).String())
	})
	return seq, dup, err
}

// keepResult writes a replay's answer into its record: the JSON response
// its decode asked for, kept in parts if it was larger than a message.
func (s *settle) keepResult(ctx context.Context, w *ReplyWriter) error {
	chunks, stages := w.Kept()
	result := json.RawMessage(bytes.Join(chunks, nil))
	if !json.Valid(result) {
		result, _ = json.Marshal(string(result))
	}
	var tooBig *RecordError
	if len(result) > maxRecordResult {
		// Bigger than a record may hold: running the job again would not
		// change that.
		tooBig = &RecordError{Status: http.StatusInsufficientStorage, Stage: StageDecode,
			Message: fmt.Sprintf("the answer (%d bytes) is too large to keep in the request record", len(result))}
		result = nil
	}
	if _, err := s.l.records.Transition(ctx, s.job.ID, func(r *Record) error {
		if r.Generation > s.job.Generation {
			return ErrNoChange
		}
		r.State, r.Generation, r.Error, r.Result, r.Stages = StateDone, s.job.Generation, tooBig, result, stages
		return nil
	}); err != nil && !errors.Is(err, ErrNoRecord) {
		return err
	}
	return nil
}

// interrupted settles a job whose grace period ran out at shutdown.
func (s *settle) interrupted(ctx context.Context, err error) {
	switch {
	case s.sent > 0:
		e := openai.NewError(http.StatusBadGateway, "the %s worker shut down mid-answer", s.l.cfg.Stage)
		s.failForGood(ctx, e, fmt.Errorf("interrupted by shutdown after output: %w", err), true)
	case s.l.cfg.Stage == StageDecode && len(s.job.KV) > 0 && !s.ran:
		// Its engine never ran it (it waited for a busy engine, say).
		s.unrun(ctx, fmt.Errorf("interrupted by shutdown before its engine ran it: %w", err))
	case s.l.cfg.Stage == StageDecode && len(s.job.KV) > 0:
		s.regenerate(ctx, wasteShutdown, "interrupted by shutdown; its KV may have been read", false)
	default:
		s.log.Warn("job interrupted by shutdown; handing it back", logging.Err(err))
		if err := s.msg.Nak(); err != nil {
			s.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
		}
	}
}

// failed settles a handler's error: a retry, a new generation, or the
// request's end.
func (s *settle) failed(ctx context.Context, err error) {
	var f *Failure
	if !errors.As(err, &f) {
		f = &Failure{Err: err}
	}
	client := f.Client
	if client == nil {
		client = openai.NewError(http.StatusBadGateway, "%s failed: %v", s.l.cfg.Stage, err)
	}
	if f.Permanent {
		if f.Rejected && s.l.cfg.Stage == StageDecode {
			// The engine refused the request before running it: no read.
			s.ran = false
			s.release(ctx, "the decode engine refused the request")
		}
		s.failForGood(ctx, client, err, !f.Reported)
		return
	}
	switch {
	case f.HandBack && s.sent == 0 && s.job.HandBacks < maxHandBacks:
		s.handBack(ctx, err)
	case s.sent > 0:
		// The client has part of the answer: no attempt can start over.
		e := openai.NewError(http.StatusBadGateway, "the %s stage failed mid-answer", s.l.cfg.Stage)
		s.failForGood(ctx, e, err, true)
	case s.l.cfg.Stage == StageDecode && len(s.job.KV) > 0 && f.Unread:
		// Before output, and the engine never ran it: the KV is unread
		// (and s.ran false, see process).
		s.log.Warn("decode failed before its engine ran it", logging.Err(err))
		s.regenerate(ctx, wasteDecodeFailed, "decode failed before its engine ran it: "+err.Error(), true)
	case s.l.cfg.Stage == StageDecode && len(s.job.KV) > 0:
		// Before output, but the engine may have read the KV blocks.
		s.log.Warn("decode failed before output", logging.Err(err))
		s.regenerate(ctx, wasteDecodeFailed, "decode failed before output: "+err.Error(), false)
	case s.attempt < s.l.cfg.MaxDeliver:
		s.l.cfg.Metrics.retry(s.l.cfg.Stage, "retry")
		delay := retryDelay(s.l.cfg.RetryBase, s.attempt)
		s.log.Warn("job failed; retrying", logging.Err(err), "retry_in", delay.String())
		if err := s.msg.NakWithDelay(delay); err != nil {
			s.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
		}
	default:
		e := openai.NewError(client.Status(), "%s (after %d attempts)", client.Message, s.attempt)
		s.failForGood(ctx, e, err, true)
	}
}

// handBack stores a copy of a job that never reached an engine, under a
// new message id, and acks this one: another worker takes it as if it were
// new, with its KV (a handoff's) unread and its deliveries uncounted.
func (s *settle) handBack(ctx context.Context, why error) {
	s.unclaimKV(ctx) // unread: the next delivery claims it
	next := *s.job
	next.HandBacks++
	if _, _, err := s.publishRetry(ctx, next.Msg(s.l.cfg.Stage), "hand-back"); err != nil {
		s.log.Warn("could not hand the job back; retrying it later", logging.Err(err))
		if nerr := s.msg.NakWithDelay(retryDelay(s.l.cfg.RetryBase, s.attempt)); nerr != nil {
			s.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(nerr))
		}
		return
	}
	s.l.cfg.Metrics.retry(s.l.cfg.Stage, "hand_back")
	s.log.Debug("job handed back", "reason", why.Error(), "hand_backs", next.HandBacks)
	if err := s.msg.DoubleAck(ctx); err != nil {
		s.log.Warn("ack failed; the job will be redelivered and dropped", logging.Err(err))
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

// waste is why a prefill's KV went unread: pdq_prefills_wasted_total's
// reason.
type waste string

const (
	wasteKVTTL        waste = "kv_ttl"
	wasteRedelivered  waste = "redelivered"
	wasteDecodeFailed waste = "decode_failed"
	wasteShutdown     waste = "shutdown"
)

var wasteReasons = []waste{wasteKVTTL, wasteRedelivered, wasteDecodeFailed, wasteShutdown}

// regenerate sends the request back to prefill as its next generation:
// new KV, new message ids; its prefill was wasted, for reason. release
// says whether this handoff's KV was certainly never read, and so is
// freed.
func (s *settle) regenerate(ctx context.Context, reason waste, why string, release bool) {
	l, job := s.l, s.job
	l.cfg.Metrics.wasted(reason)
	if release {
		s.release(ctx, why)
	}
	s.kvSpent = true // read, released, or unknowable: never released from here on
	if job.Generation >= l.cfg.MaxGenerations {
		e := openai.NewError(http.StatusBadGateway, "the request failed in %d generations; the last: %s", job.Generation, why)
		s.failForGood(ctx, e, errors.New(why), true)
		return
	}
	next := *job
	next.Generation, next.KV, next.Prefill = job.Generation+1, nil, nil
	moved, err := s.storeGeneration(ctx, &next, StagePrefill, "new generation")
	if err != nil {
		e := openai.NewError(http.StatusServiceUnavailable, "could not queue the request for a new prefill: %v", err)
		s.failForGood(ctx, e, err, true)
		return
	}
	if !moved {
		s.term("the request moved on while it was sent back to prefill")
		return
	}
	l.cfg.Metrics.retry(l.cfg.Stage, "regenerate")
	s.log.Info("request sent back to prefill", "reason", why, "next_generation", next.Generation)
	s.term("regenerated: " + why)
}

// storeGeneration stores next, the request's next generation, on stage's
// queue, then records it: a job always exists for the generation a live
// record names, and a stored job whose request has ended meanwhile is
// dropped at its pull. It reports whether the request moved on to next.
// When the request ended, or was taken over, meanwhile, the job just stored
// is deleted again, so that it cannot linger to meet a later retry under
// its message ids.
func (s *settle) storeGeneration(ctx context.Context, next *Job, stage Stage, what string) (bool, error) {
	l, job := s.l, s.job
	next.RecordRevision = 0 // the record is written after the job
	seq, _, err := s.publishRetry(ctx, next.Msg(stage), what)
	if err != nil {
		return false, err
	}
	moved := false
	if _, err := l.records.Transition(ctx, job.ID, func(r *Record) error {
		if r.Generation > job.Generation || r.State.Ended() || r.Gateway != job.GatewayID() {
			return ErrNoChange
		}
		r.Generation, moved = next.Generation, true
		return nil
	}); err != nil && !errors.Is(err, ErrNoRecord) {
		moved = true // not knowing, keep the job: its pull checks the record again
		s.log.Warn("could not record the "+what+"; its job runs all the same", logging.Err(err))
	}
	if !moved && seq > 0 {
		if st, err := l.js.Stream(ctx, stageStream(stage)); err == nil {
			if err := st.DeleteMsg(ctx, seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
				s.log.Warn("could not delete the "+what+"'s job; its pull will drop it", logging.Err(err))
			}
		}
	}
	return moved, nil
}

// migrate queues the continuation of a decode that failed after output, as
// the request's next generation, and acks this one. The gateway has every
// chunk sent so far (the handler's Moved), and takes the continuation's
// chunks as the same stream.
func (s *settle) migrate(ctx context.Context, next *Job) {
	l := s.l
	moved, err := s.storeGeneration(ctx, next, StageDecode, "migration")
	if err != nil {
		e := openai.NewError(http.StatusBadGateway, "the decode engine's stream broke off, and could not be moved: %v", err)
		s.failForGood(ctx, e, err, true)
		return
	}
	if !moved {
		s.log.Info("the request ended while its decode was being moved")
	} else {
		l.cfg.Metrics.Migrated(l.cfg.Pool)
		s.log.Info("decode moved to another engine after output", "chunks_sent", next.Resume.Chunks,
			"tokens_sent", next.Resume.Tokens, "next_generation", next.Generation)
	}
	if err := s.msg.DoubleAck(ctx); err != nil {
		s.log.Warn("ack failed; the job will be redelivered and dropped", logging.Err(err))
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
		case errors.Is(err, errDLQFull):
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
	s.end(ctx, StateFailed, &RecordError{Status: status, Message: client.Message, Stage: s.l.cfg.Stage})
	if answer {
		s.answer(client)
	}
	s.term(client.Message)
}

// drop removes a job that must not run, releasing its handoff's KV if no
// decode engine can have read it.
func (s *settle) drop(ctx context.Context, why string) {
	s.log.Debug("job dropped: " + why)
	if s.l.cfg.Stage == StageDecode && (s.attempt == 1 || s.rebuilt()) {
		s.release(ctx, why) // a rebuilt one's only if unclaimed: see release
	}
	s.term(why)
}

// claimKV claims this handoff's KV for this delivery, its one reader (see
// kvread.go), and reports whether the delivery holds it. Not knowing
// (NATS did not answer) counts as not holding it: a decode then goes back
// to prefill and a release is not made, rather than read the KV twice.
func (s *settle) claimKV(ctx context.Context) bool {
	if s.kvClaimed || s.l.kvReads == nil || len(s.job.KV) == 0 {
		return true // held, or nothing to claim
	}
	// As long as a publish waits for a stream's new leader.
	cctx, cancel := context.WithTimeout(ctx, publishFailover)
	defer cancel()
	ok, err := s.l.kvReads.claim(cctx, s.job, s.delivery)
	if err != nil {
		s.l.cfg.Metrics.retry(s.l.cfg.Stage, "kv_claim_failed")
		s.log.Warn("could not claim the handoff's KV; taking it as read", logging.Err(err))
		return false
	}
	s.kvClaimed = ok
	return ok
}

// unclaimKV gives back this delivery's claim of a KV it did not read.
func (s *settle) unclaimKV(ctx context.Context) {
	if !s.kvClaimed {
		return
	}
	s.kvClaimed = false
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.l.kvReads.unclaim(cctx, s.job, s.delivery); err != nil {
		s.log.Warn("could not give back the handoff's KV claim: its next delivery sends it to prefill", logging.Err(err))
	}
}

// release frees the prefill engine's KV blocks of this handoff, and
// reports whether it did.
func (s *settle) release(ctx context.Context, why string) bool {
	// A second read of the blocks fails, and with NIXL v1 kills the decode
	// engine: release only a handoff no engine can have read.
	if s.l.cfg.Release == nil || len(s.job.KV) == 0 || s.ran || s.kvSpent {
		return false
	}
	s.kvSpent = true
	if p := s.job.Prefill; p != nil && time.Since(p.Ended()) > s.l.cfg.KVTTL*11/10 {
		// Past the lease (taken to be over 1.1 times the KV TTL: vLLM's
		// 30 s against the default 25 s), the blocks are presumably freed
		// already, and a read of freed blocks fails the same way.
		s.log.Debug("not releasing KV blocks that have presumably expired", "reason", why)
		return false
	}
	if !s.claimKV(ctx) {
		s.log.Debug("not releasing KV blocks another reader has claimed", "reason", why)
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if e := s.l.cfg.EngineSlots; e != nil && !s.engineHeld {
		// A release is an engine call: it waits for a slot like any.
		if err := e.acquire(rctx); err != nil {
			s.log.Warn("no engine slot to release the prefill's KV blocks; they stay held until their lease ends", "reason", why, logging.Err(err))
			return false
		}
		defer e.Release()
	}
	if err := s.l.cfg.Release(rctx, s.job); err != nil {
		var f *Failure
		if errors.As(err, &f) && f.Unread && ctx.Err() == nil && !s.direct {
			// The engine did not run the call (it is down, or failing
			// before it runs anything): the blocks are still held, and a
			// decode worker tries again from the release queue.
			s.log.Debug("the release call did not run; queued to try again", "reason", why, logging.Err(err))
			s.unclaimKV(ctx)
			next := *s.job
			next.HandBacks++ // a new copy: its own message id
			s.queueRelease(ctx, &next)
			return false
		}
		s.log.Warn("could not release the prefill's KV blocks; they stay held until their lease ends", "reason", why, logging.Err(err))
		return false
	}
	s.l.released.Add(1)
	s.l.cfg.Metrics.released(s.l.cfg.Pool)
	s.log.Debug("released the prefill's KV blocks", "reason", why)
	return true
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
func (s *settle) end(ctx context.Context, state State, e *RecordError) {
	if err := s.l.records.End(ctx, s.job.ID, s.job.Generation, state, e, s.stages()...); err != nil {
		s.log.Warn("could not record the request's end", "state", string(state), logging.Err(err))
	}
}

func (s *settle) term(reason string) {
	if err := s.msg.TermWithReason(truncate(reason, 256)); err != nil {
		s.log.Warn("term failed; the job will be redelivered and dropped", logging.Err(err))
	}
}

// errDLQFull means the dead-letter stream refused an entry: it is full.
var errDLQFull = errors.New("the dead-letter stream is full")

// deadLetter keeps a failed job for replay: its message as it was, with
// the stage, status and reason. WorkQueue streams delete a terminated
// message, so it is stored before the term. One entry per request id; a
// full DLQ refuses new entries rather than dropping old ones, and each
// refusal is counted here.
func (l *StageLoop) deadLetter(ctx context.Context, msg jetstream.Msg, id string, status int, reason string) error {
	pool := msg.Headers().Get(HeaderPool)
	if !ValidPool(pool) {
		pool = l.cfg.Pool
	}
	m := nats.NewMsg(DLQSubject(pool, id))
	for k, v := range msg.Headers() {
		m.Header[k] = v
	}
	m.Data = msg.Data()
	err := storeDeadLetter(ctx, l.js, m, id, l.cfg.Stage, status, reason, l.cfg.Metrics)
	if errors.Is(err, errDLQFull) {
		l.dlqRefused.Add(1)
	}
	return err
}

// DeadLetterJob keeps a request that the gateway failed on the way back
// (its decode restarted after output, its reply lost or silent) for
// replay, as a worker keeps the jobs it fails: its job as the gateway
// queued it, the client's body and all.
func DeadLetterJob(ctx context.Context, js jetstream.Publisher, job *Job, stage Stage, status int, reason string, metrics *Metrics) error {
	m := job.Msg(stage)
	m.Subject = DLQSubject(job.Pool, job.ID)
	return storeDeadLetter(ctx, js, m, job.ID, stage, status, reason, metrics)
}

// storeDeadLetter labels m, a job's message as it was, with the stage,
// status and reason of its failure, and stores it in the dead-letter
// stream at its subject, once per generation.
func storeDeadLetter(ctx context.Context, js jetstream.Publisher, m *nats.Msg, id string, stage Stage, status int, reason string, metrics *Metrics) error {
	m.Header[HeaderStage] = []string{string(stage)}
	m.Header[HeaderStatus] = []string{strconv.Itoa(status)}
	m.Header[HeaderReason] = []string{truncate(reason, 1024)}
	m.Header[nats.MsgIdHdr] = []string{id + "/dlq/" + m.Header.Get(HeaderGeneration)}
	// As any job's publish: across a failover, and refused by a full
	// stream or one whose store does not write (a full disk, and PDQ_DLQ
	// is not rebuilt: until NATS restarts).
	_, err := publishSeq(ctx, js, m)
	switch {
	case errors.Is(err, ErrDuplicate):
		return nil // counted when it was stored
	case errors.Is(err, ErrQueueFull), errors.Is(err, ErrNotStoring):
		metrics.deadLetterRefused(stage)
		return fmt.Errorf("%w (%d entries or %d bytes, or its store does not write): %w", errDLQFull, dlqMaxMsgs, dlqMaxBytes, err)
	case err != nil:
		return err
	}
	metrics.deadLetter(stage)
	return nil
}
