package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Errors of [Submitter.Submit].
var (
	// ErrDuplicate means a request with this id is live, or has delivered
	// its answer: the job was not queued again.
	ErrDuplicate = errors.New("a request with this id is live or has delivered")
	// ErrQueueFull means the stage's stream is at its bound. Nothing queued
	// was dropped to make room.
	ErrQueueFull = errors.New("the job queue is full")
)

// JetStream API error codes that mean a bounded stream or account is full.
const (
	errCodeStoreFailed           = 10077
	errCodeInsufficientResources = 10023
)

// Submitter queues the gateway's jobs: it claims the request's id in its
// record, then publishes the job.
type Submitter struct {
	js       jetstream.Publisher
	records  *Records
	liveness *Liveness
}

// NewSubmitter returns a Submitter that publishes with js, records in
// records, and asks liveness whether the gateway of an earlier request with
// the same id still runs.
func NewSubmitter(js jetstream.Publisher, records *Records, liveness *Liveness) *Submitter {
	return &Submitter{js: js, records: records, liveness: liveness}
}

// Claim is a request's record as Submit wrote it, with the revision it
// got. The gateway's write of the request's end starts from it (see
// [Records.TransitionFrom]) instead of reading the record back: on the
// path where nothing else wrote the record, that saves a round trip per
// request.
type Claim struct {
	rec *Record
	rev uint64 // 0: not known
}

// Submit records job as queued and stores it on stage's stream. One id is
// one request whatever path it takes: an id whose request is live, or has
// delivered, is refused with ErrDuplicate. An id whose earlier request
// ended without delivering (failed, cancelled, expired, or its gateway
// gone) is a retry, run as the next generation. Submit sets
// job.Generation, and returns the record it wrote.
func (s *Submitter) Submit(ctx context.Context, stage Stage, job *Job) (*Claim, error) {
	job.Generation = 1
	if err := job.Validate(); err != nil {
		return nil, err
	}
	now := job.Submitted
	if now.IsZero() {
		now = time.Now()
	}
	rec := &Record{
		ID: job.ID, State: StateQueued, Generation: 1, Model: job.Model, Pool: job.Pool,
		Endpoint: job.Endpoint, Stream: job.Stream, DecodeOnly: stage == StageDecode,
		Gateway: job.GatewayID(), Owner: job.Owner, ClientID: job.ClientID, Created: now, Updated: now, Deadline: job.Deadline,
	}
	claim, err := s.Claim(ctx, rec)
	if err != nil {
		return nil, err
	}
	job.Generation, job.RecordRevision = rec.Generation, claim.rev
	if err = PublishGeneration(ctx, s.js, s.records, job, stage); err != nil {
		status := 503
		if errors.Is(err, ErrQueueFull) {
			status = 429
		}
		// The id must not stay claimed by a request that never queued.
		if rerr := s.records.End(context.WithoutCancel(ctx), job.ID, job.Generation, StateFailed,
			&RecordError{Status: status, Message: err.Error()}); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	if job.Generation != rec.Generation {
		claim.rev = 0 // publishGeneration wrote the record again
	}
	return claim, nil
}

// Claim writes rec, a new request's record (state queued, generation 1),
// under the rules of Submit: an id whose request is live or has delivered
// is refused with ErrDuplicate, one whose request ended without
// delivering is taken over as the next generation (rec.Generation says
// which). Submit claims a job's id with it; the gateway claims a batched
// request's own id, whose prompts run under ids of their own.
func (s *Submitter) Claim(ctx context.Context, rec *Record) (*Claim, error) {
	rev, err := s.claim(ctx, rec)
	if IsWrongRevision(err) {
		rev, err = s.claimRetry(ctx, rec)
	}
	if err != nil {
		return nil, err
	}
	return &Claim{rec: rec, rev: rev}, nil
}

// claim creates rec and returns its revision. A create that got no answer
// (its bucket's leader died with it, say) may have been stored: the record
// is read, and if it is this very claim the claim stands; if there is
// none, the create is tried again.
func (s *Submitter) claim(ctx context.Context, rec *Record) (uint64, error) {
	create := func() (uint64, error) {
		cctx, cancel := context.WithTimeout(ctx, publishAttempt)
		defer cancel()
		return s.records.Create(cctx, rec)
	}
	rev, err := create()
	var lasts []uint64 // the bucket's last sequence after each unanswered create, while it answers
	for range 3 {
		if !NoAnswer(err) || ctx.Err() != nil {
			return rev, err
		}
		old, orev, gerr := s.records.Get(ctx, rec.ID)
		if errors.Is(gerr, ErrNoRecord) {
			if last, ok := answersAbout(ctx, s.js, "$KV."+BucketRequests+"."+rec.ID); ok {
				lasts = append(lasts, last)
			}
		}
		switch {
		case errors.Is(gerr, ErrNoRecord) && len(lasts) >= 2 && lasts[len(lasts)-1] == lasts[len(lasts)-2]:
			// Twice unanswered, not stored, and nothing stored in between:
			// the bucket's store does not write (see doctor.go).
			return 0, fmt.Errorf("claim %s: %w", rec.ID, ErrNotStoring)
		case errors.Is(gerr, ErrNoRecord):
			rev, err = create()
		case gerr == nil && old.Gateway == rec.Gateway && old.Created.Equal(rec.Created):
			return recoveredRevision(old, orev, rec), nil // stored before its answer was lost
		case gerr == nil:
			return 0, jetstream.ErrKeyExists // another request's: see claimRetry
		default:
			err = gerr
		}
	}
	return rev, err
}

// recoveredRevision is the revision that a claim found stored after its
// create's answer was lost passes on: the stored record's while that is
// still the claim as written, else 0 (not known). Something may have
// written it since (an End does not look at the gateway), and a job that
// carried that write's revision would have admit skip its checks.
func recoveredRevision(stored *Record, rev uint64, claim *Record) uint64 {
	if stored.State != StateQueued || stored.Generation != claim.Generation {
		return 0
	}
	return rev
}

// noAnswer reports whether a NATS call failed for want of an answer, not
// because it was refused: it may have been carried out.
func NoAnswer(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders)
}

// claimRetry takes over the record of an earlier request with rec's id,
// if that request has ended without delivering.
func (s *Submitter) claimRetry(ctx context.Context, rec *Record) (uint64, error) {
	old, rev, err := s.records.Get(ctx, rec.ID)
	if err != nil {
		return 0, err
	}
	switch {
	case old.State == StateDone:
		return 0, fmt.Errorf("request %s: %w", rec.ID, ErrDuplicate)
	case old.Live() && !old.Deadline.Before(time.Now()) && s.liveness.Alive(ctx, old.Gateway):
		return 0, fmt.Errorf("request %s: %w", rec.ID, ErrDuplicate)
	}
	rec.Generation = old.Generation + 1
	rec.Replays = old.Replays
	rev, err = s.records.Update(ctx, rec, rev)
	if err != nil {
		if IsWrongRevision(err) {
			return 0, fmt.Errorf("request %s: %w", rec.ID, ErrDuplicate) // another retry won
		}
		return 0, fmt.Errorf("record %s: %w", rec.ID, err)
	}
	return rev, nil
}

// publishGeneration stores a job its record has just claimed. The record's
// generation may be one whose message ids JetStream still deduplicates (a
// regeneration of an earlier request under this id, within the dedup
// window): then the record and the job take the next generation, up to 3
// times. It sets job.Generation to the one stored.
func PublishGeneration(ctx context.Context, js jetstream.Publisher, records *Records, job *Job, stage Stage) error {
	job.Origin = job.Generation // a new request
	err := Publish(ctx, js, job.Msg(stage))
	for range 3 {
		if !errors.Is(err, ErrDuplicate) {
			return err
		}
		rec, terr := records.Transition(ctx, job.ID, func(r *Record) error {
			r.Generation++
			return nil
		})
		if terr != nil {
			return terr
		}
		job.Generation, job.Origin, job.RecordRevision = rec.Generation, rec.Generation, 0
		err = Publish(ctx, js, job.Msg(stage))
	}
	return err
}

// publish stores msg on its stream, deduplicated by its Nats-Msg-Id.
func Publish(ctx context.Context, js jetstream.Publisher, msg *nats.Msg) error {
	_, err := PublishSeq(ctx, js, msg)
	return err
}

// Publishing across a failover. A stream has no leader for seconds after
// its leader's node is lost (nats-server elects a new one 4 to 9 s after
// the last heartbeat): a publish meanwhile finds no responders, and one
// sent to the dying leader is never answered. Either way the message was
// not acknowledged, so it is sent again, each attempt bounded by
// publishAttempt, for up to publishFailover in all (or until ctx ends),
// instead of failing after the client's default half second of retries
// or waiting out a 5 s time-out on the first attempt. A message whose
// lost attempt was stored after all comes back as a duplicate, as it
// would on any retry: every message published here has a Nats-Msg-Id.
const (
	publishAttempt    = 2 * time.Second
	PublishRetryWait  = 250 * time.Millisecond
	PublishFailover   = 15 * time.Second
	publishNoLeaderTo = int(publishAttempt / PublishRetryWait)
)

// publishSeq is publish that also returns the message's stream sequence
// (for a duplicate, the earlier message's).
func PublishSeq(ctx context.Context, js jetstream.Publisher, msg *nats.Msg) (uint64, error) {
	giveUp := time.Now().Add(PublishFailover)
	silent, last := 0, uint64(0) // unanswered attempts in a row; the stream's last sequence at the first
	for {
		actx, cancel := context.WithTimeout(ctx, publishAttempt)
		ack, err := js.PublishMsg(actx, msg, jetstream.WithRetryWait(PublishRetryWait), jetstream.WithRetryAttempts(publishNoLeaderTo))
		cancel()
		switch {
		case err == nil && ack.Duplicate:
			return ack.Sequence, fmt.Errorf("publish %s: %w", msg.Subject, ErrDuplicate)
		case err == nil:
			return ack.Sequence, nil
		case isFull(err):
			return 0, fmt.Errorf("publish %s: %w: %w", msg.Subject, ErrQueueFull, err)
		case ctx.Err() == nil && time.Now().Before(giveUp) && unanswered(err):
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
				silent = 0 // no leader yet: a failover
				continue
			}
			seq, ok := answersAbout(ctx, js, msg.Subject)
			switch {
			case !ok:
				silent = 0
			case silent == 0 || seq != last:
				silent, last = 1, seq
			default:
				// Unanswered twice, with nothing stored in between.
				return 0, fmt.Errorf("publish %s: %w", msg.Subject, ErrNotStoring)
			}
			continue
		}
		return 0, fmt.Errorf("publish %s: %w", msg.Subject, err)
	}
}

// ErrNotStoring means a stream answers about itself but stores nothing it
// is sent: its store latched a write error (a full disk; see doctor.go).
// Trying again does not help until the stream is rebuilt.
var ErrNotStoring = errors.New("the stream does not store (its disk may be full)")

// answersAbout reports whether the stream that stores subject answers
// about itself, within a second, and its last sequence. Only a stream of
// one replica counts: one of several whose leader stops answering hands
// over to another replica (a store that latched a write error steps
// down), and what looks like not storing is a failover.
func answersAbout(ctx context.Context, js jetstream.Publisher, subject string) (last uint64, ok bool) {
	sm, isManager := js.(jetstream.StreamManager)
	if !isManager {
		return 0, false
	}
	actx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	name, err := sm.StreamNameBySubject(actx, subject)
	if err != nil {
		return 0, false
	}
	st, err := sm.Stream(actx, name)
	if err != nil {
		return 0, false
	}
	info := st.CachedInfo()
	if info.Config.Replicas > 1 || info.Cluster != nil && info.Cluster.Leader == "" {
		return 0, false
	}
	return info.State.LastSeq, true
}

// unanswered reports whether a publish failed for want of an answer (no
// stream leader, or none in time), not because the stream refused it.
func unanswered(err error) bool {
	return errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout)
}

func isFull(err error) bool {
	var jsErr jetstream.JetStreamError
	if !errors.As(err, &jsErr) || jsErr.APIError() == nil {
		return false
	}
	api := jsErr.APIError()
	switch api.ErrorCode {
	case errCodeInsufficientResources:
		return true
	case errCodeStoreFailed:
		return strings.Contains(api.Description, "maximum")
	}
	return false
}
