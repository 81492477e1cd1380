package stage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// storeHandoff publishes a prefill's result, retrying the publish (never
// the prefill) with back-off for up to 10 s. A duplicate may be this
// handoff, a try whose answer was lost, or that of an earlier run of this
// prefill (a restarted nats-server forgot its delivery, or its ack came
// late): then this run's KV has no reader, and is released.
func (s *settle) storeHandoff(ctx context.Context, m *nats.Msg, h *dispatcher.Job) error {
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
// is taken, see dispatcher/kvread.go). Not knowing (NATS did not answer), it is taken
// as this one: the KV is left to its lease rather than released under a
// decode.
func (s *settle) storedIsThis(ctx context.Context, seq uint64, h *dispatcher.Job) bool {
	st, err := s.l.js.Stream(ctx, dispatcher.StreamDecode)
	if err != nil {
		return true
	}
	raw, err := st.GetMsg(ctx, seq)
	if err != nil {
		return !errors.Is(err, jetstream.ErrMsgNotFound)
	}
	stored, err := dispatcher.ParseJob(raw.Header, raw.Data)
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
	s.preferDecode(d)
	m := d.handoff.Msg(dispatcher.StageDecode)
	// With room to spare for the headers a dead letter adds: a handoff
	// that fits, but whose dead letter would not, could never fail.
	maxPayload := s.l.nc.MaxPayload()
	if len(d.handoff.KV) == 0 || maxPayload <= 4<<10 || int64(msgSize(m)) <= maxPayload-4<<10 {
		return m
	}
	s.log.Warn("the handoff is larger than a NATS message: sent decode-only, its KV left to the prefill engine's lease",
		"body_bytes", len(d.handoff.Body), "kv_bytes", len(d.handoff.KV), "max_payload", maxPayload)
	s.l.cfg.Metrics.Shared().DecodeOnly("handoff_too_large")
	d.Forward()
	s.preferDecode(d) // a new copy of the job, with its preference
	return d.handoff.Msg(dispatcher.StageDecode)
}

// preferDecode keeps the handoff's decode preference only while the
// decode workers take preferred jobs (see pull.DecodeGate.Preferable).
func (s *settle) preferDecode(d *Delivery) {
	if g := s.l.decodeGate; d.handoff.PreferDecode != "" && g != nil && !g.Preferable(d.handoff.PreferDecode) {
		d.handoff.PreferDecode = ""
	}
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
func (s *settle) queueRelease(ctx context.Context, h *dispatcher.Job) {
	m := h.Msg(dispatcher.StageDecode)
	m.Subject = dispatcher.ReleaseSubject(h.Pool, h.ID)
	// One release per generation; a release tried again (its call did
	// not run) is a copy of its own, counted in its hand-backs.
	// Keyed by the KV too: two runs of one prefill each have their own.
	m.Header[nats.MsgIdHdr] = []string{h.ID + "/r" + strconv.Itoa(h.Generation) + "." + strconv.Itoa(h.HandBacks) + "." + dispatcher.KVReadKey(h)[:8]}
	if h.HandBacks > 0 {
		m.Header[headerNotBefore] = []string{strconv.FormatInt(time.Now().Add(releaseRetry).UnixMilli(), 10)}
	}
	if err := dispatcher.Publish(ctx, s.l.js, m); err != nil && !errors.Is(err, dispatcher.ErrDuplicate) {
		// The store refuses it too (a full disk): ask a decode worker of
		// the pool to release it now, at most once.
		s.log.Warn("could not queue the release of the prefill's KV; asking a decode worker directly", logging.Err(err))
		m.Subject = dispatcher.ReleaseNowSubject(h.Pool)
		delete(m.Header, nats.MsgIdHdr)
		delete(m.Header, headerNotBefore)
		go func() {
			resp, err := s.l.nc.RequestMsg(m, releaseNowWait)
			if err == nil && resp.Header.Get(dispatcher.HeaderStatus) != "" {
				err = fmt.Errorf("the decode worker answered %s", resp.Header.Get(dispatcher.HeaderStatus))
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
		seq, err = dispatcher.PublishSeq(ctx, s.l.js, msg)
		switch {
		case errors.Is(err, dispatcher.ErrDuplicate):
			dup = true
			return nil
		case errors.Is(err, dispatcher.ErrNotStoring):
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
func (s *settle) keepResult(ctx context.Context, w *reply.Writer) error {
	chunks, stages := w.Kept()
	result := json.RawMessage(bytes.Join(chunks, nil))
	if !json.Valid(result) {
		result, _ = json.Marshal(string(result))
	}
	var tooBig *dispatcher.RecordError
	if len(result) > maxRecordResult {
		// Bigger than a record may hold: running the job again would not
		// change that.
		tooBig = &dispatcher.RecordError{Status: http.StatusInsufficientStorage, Stage: dispatcher.StageDecode,
			Message: fmt.Sprintf("the answer (%d bytes) is too large to keep in the request record", len(result))}
		result = nil
	}
	if _, err := s.l.records.Transition(ctx, s.job.ID, func(r *dispatcher.Record) error {
		if r.Generation > s.job.Generation {
			return dispatcher.ErrNoChange
		}
		r.State, r.Generation, r.Error, r.Result, r.Stages = dispatcher.StateDone, s.job.Generation, tooBig, result, stages
		return nil
	}); err != nil && !errors.Is(err, dispatcher.ErrNoRecord) {
		return err
	}
	return nil
}

// claimKV claims this handoff's KV for this delivery, its one reader (see
// dispatcher/kvread.go), and reports whether the delivery holds it. Not knowing
// (NATS did not answer) counts as not holding it: a decode then goes back
// to prefill and a release is not made, rather than read the KV twice.
func (s *settle) claimKV(ctx context.Context) bool {
	if s.kvClaimed || s.l.kvReads == nil || len(s.job.KV) == 0 {
		return true // held, or nothing to claim
	}
	// As long as a publish waits for a stream's new leader.
	cctx, cancel := context.WithTimeout(ctx, dispatcher.PublishFailover)
	defer cancel()
	ok, err := s.l.kvReads.Claim(cctx, s.job, s.delivery)
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
	if err := s.l.kvReads.Unclaim(cctx, s.job, s.delivery); err != nil {
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
		if err := e.Acquire(rctx); err != nil {
			s.log.Warn("no engine slot to release the prefill's KV blocks; they stay held until their lease ends", "reason", why, logging.Err(err))
			return false
		}
		defer e.Release()
	}
	if err := s.l.cfg.Release(rctx, s.job); err != nil {
		var f *verdict.Failure
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
