package stage

import (
	"context"
	"errors"
	"net/http"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// handBack stores a copy of a job that never reached an engine, under a
// new message id, and acks this one: another worker takes it as if it were
// new, with its KV (a handoff's) unread and its deliveries uncounted.
func (s *settle) handBack(ctx context.Context, why error) {
	s.unclaimKV(ctx) // unread: the next delivery claims it
	next := *s.job
	next.HandBacks++
	// This worker's engine may be the trouble: any worker of the stage.
	// A prefill's decode preference stands.
	if next.Prefer = ""; s.l.cfg.Stage == dispatcher.StageDecode {
		next.PreferDecode = ""
	}
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

// regenerate sends the request back to prefill as its next generation:
// new KV, new message ids; its prefill was wasted, for reason. release
// says whether this handoff's KV was certainly never read, and so is
// freed.
func (s *settle) regenerate(ctx context.Context, reason verdict.Waste, why string, release bool) {
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
	moved, err := s.storeGeneration(ctx, &next, dispatcher.StagePrefill, "new generation")
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
func (s *settle) storeGeneration(ctx context.Context, next *dispatcher.Job, stage dispatcher.Stage, what string) (bool, error) {
	l, job := s.l, s.job
	next.RecordRevision = 0                 // the record is written after the job
	next.Prefer, next.PreferDecode = "", "" // a new generation goes to any worker
	seq, _, err := s.publishRetry(ctx, next.Msg(stage), what)
	if err != nil {
		return false, err
	}
	moved := false
	if _, err := l.records.Transition(ctx, job.ID, func(r *dispatcher.Record) error {
		if r.Generation > job.Generation || r.State.Ended() || r.Gateway != job.GatewayID() {
			return dispatcher.ErrNoChange
		}
		r.Generation, moved = next.Generation, true
		return nil
	}); err != nil && !errors.Is(err, dispatcher.ErrNoRecord) {
		moved = true // not knowing, keep the job: its pull checks the record again
		s.log.Warn("could not record the "+what+"; its job runs all the same", logging.Err(err))
	}
	if !moved && seq > 0 {
		if st, err := l.js.Stream(ctx, dispatcher.StageStream(stage)); err == nil {
			if err := dispatcher.DeleteMsg(ctx, st, seq); err != nil {
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
func (s *settle) migrate(ctx context.Context, next *dispatcher.Job) {
	l := s.l
	moved, err := s.storeGeneration(ctx, next, dispatcher.StageDecode, "migration")
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

// deadLetter keeps a failed job for replay: its message as it was, with
// the stage, status and reason. WorkQueue streams delete a terminated
// message, so it is stored before the term. One entry per request id; a
// full DLQ refuses new entries rather than dropping old ones, and each
// refusal is counted here.
func (l *Loop) deadLetter(ctx context.Context, msg jetstream.Msg, id string, status int, reason string) error {
	pool := msg.Headers().Get(dispatcher.HeaderPool)
	if !dispatcher.ValidPool(pool) {
		pool = l.cfg.Pool
	}
	m := nats.NewMsg(dispatcher.DLQSubject(pool, id))
	for k, v := range msg.Headers() {
		m.Header[k] = v
	}
	m.Data = msg.Data()
	err := dispatcher.StoreDeadLetter(ctx, l.js, m, id, l.cfg.Stage, status, reason, l.cfg.Metrics.Shared())
	if errors.Is(err, dispatcher.ErrDLQFull) {
		l.dlqRefused.Add(1)
	}
	return err
}
