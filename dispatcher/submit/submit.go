package submit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
)

// Gateways tells whether a gateway still holds its requests: a
// [Liveness], which pings it.
type Gateways interface {
	Alive(ctx context.Context, gatewayID string) bool
}

// Submitter queues the gateway's jobs: it claims the request's id in its
// record, then publishes the job.
type Submitter struct {
	js       jetstream.Publisher
	records  *dispatcher.Records
	liveness Gateways
}

// NewSubmitter returns a Submitter that publishes with js, records in
// records, and asks liveness whether the gateway of an earlier request with
// the same id still runs.
func NewSubmitter(js jetstream.Publisher, records *dispatcher.Records, liveness Gateways) *Submitter {
	return &Submitter{js: js, records: records, liveness: liveness}
}

// Claim is a request's record as Submit wrote it, with the revision it
// got. The gateway's write of the request's end starts from it (see
// [Records.TransitionFrom]) instead of reading the record back: on the
// path where nothing else wrote the record, that saves a round trip per
// request.
type Claim struct {
	rec *dispatcher.Record
	rev uint64 // 0: not known
}

// Transition writes change over the record as the claim wrote it (see
// [Records.TransitionFrom]).
func (c *Claim) Transition(ctx context.Context, records *dispatcher.Records, change func(*dispatcher.Record) error) (*dispatcher.Record, error) {
	return records.TransitionFrom(ctx, c.rec, c.rev, change)
}

// Submit records job as queued and stores it on stage's stream. One id is
// one request whatever path it takes: an id whose request is live, or has
// delivered, is refused with ErrDuplicate. An id whose earlier request
// ended without delivering (failed, cancelled, expired, or its gateway
// gone) is a retry, run as the next generation. Submit sets
// job.Generation, and returns the record it wrote.
func (s *Submitter) Submit(ctx context.Context, stage dispatcher.Stage, job *dispatcher.Job) (*Claim, error) {
	job.Generation = 1
	if err := job.Validate(); err != nil {
		return nil, err
	}
	rec := recordOf(job, stage)
	claim, err := s.Claim(ctx, rec)
	if err != nil {
		return nil, err
	}
	job.Generation, job.RecordRevision = rec.Generation, claim.rev
	if err = dispatcher.PublishGeneration(ctx, s.js, s.records, job, stage); err != nil {
		status := 503
		if errors.Is(err, dispatcher.ErrQueueFull) {
			status = 429
		}
		// The id must not stay claimed by a request that never queued.
		if rerr := s.records.End(context.WithoutCancel(ctx), job.ID, job.Generation, dispatcher.StateFailed,
			&dispatcher.RecordError{Status: status, Message: err.Error()}); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	if job.Generation != rec.Generation {
		claim.rev = 0 // PublishGeneration wrote the record again
	}
	return claim, nil
}

// recordOf is the record a new request's claim writes for job, which goes
// to stage first.
func recordOf(job *dispatcher.Job, stage dispatcher.Stage) *dispatcher.Record {
	now := job.Submitted
	if now.IsZero() {
		now = time.Now()
	}
	return &dispatcher.Record{
		ID: job.ID, State: dispatcher.StateQueued, Generation: 1, Model: job.Model, Pool: job.Pool,
		Endpoint: job.Endpoint, Stream: job.Stream, DecodeOnly: stage == dispatcher.StageDecode,
		Gateway: job.GatewayID(), Owner: job.Owner, ClientID: job.ClientID, Created: now, Updated: now, Deadline: job.Deadline,
	}
}

// Unrun records a request that ended before its job was published (its
// client left, or its deadline passed, while it waited in the gateway's
// fair queue): it claims the id as Submit would, and ends the record at
// once with state and e. An id another request holds is left alone
// (ErrDuplicate).
func (s *Submitter) Unrun(ctx context.Context, job *dispatcher.Job, state dispatcher.State, e *dispatcher.RecordError) error {
	rec := recordOf(job, dispatcher.StagePrefill)
	if _, err := s.Claim(ctx, rec); err != nil {
		return err
	}
	return s.records.End(ctx, job.ID, rec.Generation, state, e)
}

// Claim writes rec, a new request's record (state queued, generation 1),
// under the rules of Submit: an id whose request is live or has delivered
// is refused with ErrDuplicate, one whose request ended without
// delivering is taken over as the next generation (rec.Generation says
// which). Submit claims a job's id with it; the gateway claims a batched
// request's own id, whose prompts run under ids of their own.
func (s *Submitter) Claim(ctx context.Context, rec *dispatcher.Record) (*Claim, error) {
	rev, err := s.claim(ctx, rec)
	if dispatcher.IsWrongRevision(err) {
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
func (s *Submitter) claim(ctx context.Context, rec *dispatcher.Record) (uint64, error) {
	create := func() (uint64, error) {
		cctx, cancel := context.WithTimeout(ctx, dispatcher.PublishAttempt)
		defer cancel()
		return s.records.Create(cctx, rec)
	}
	rev, err := create()
	var lasts []uint64 // the bucket's last sequence after each unanswered create, while it answers
	for range 3 {
		if !dispatcher.NoAnswer(err) || ctx.Err() != nil {
			return rev, err
		}
		old, orev, gerr := s.records.Get(ctx, rec.ID)
		if errors.Is(gerr, dispatcher.ErrNoRecord) {
			if last, ok := dispatcher.AnswersAbout(ctx, s.js, "$KV."+dispatcher.BucketRequests+"."+rec.ID); ok {
				lasts = append(lasts, last)
			}
		}
		switch {
		case errors.Is(gerr, dispatcher.ErrNoRecord) && len(lasts) >= 2 && lasts[len(lasts)-1] == lasts[len(lasts)-2]:
			// Twice unanswered, not stored, and nothing stored in between:
			// the bucket's store does not write (see dispatcher/admin/doctor.go).
			return 0, fmt.Errorf("claim %s: %w", rec.ID, dispatcher.ErrNotStoring)
		case errors.Is(gerr, dispatcher.ErrNoRecord):
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
func recoveredRevision(stored *dispatcher.Record, rev uint64, claim *dispatcher.Record) uint64 {
	if stored.State != dispatcher.StateQueued || stored.Generation != claim.Generation {
		return 0
	}
	return rev
}

// claimRetry takes over the record of an earlier request with rec's id,
// if that request has ended without delivering. The record may be this
// claim's own: a create that went unanswered and was tried again can be
// stored after all, late (a NATS node cut off from its cluster holds it
// on its route, and delivers it once healed), and the retry then finds
// the key taken.
func (s *Submitter) claimRetry(ctx context.Context, rec *dispatcher.Record) (uint64, error) {
	old, rev, err := s.records.Get(ctx, rec.ID)
	if err != nil {
		return 0, err
	}
	switch {
	case old.Gateway == rec.Gateway && old.Created.Equal(rec.Created) && old.Generation == rec.Generation:
		return recoveredRevision(old, rev, rec), nil
	case old.State == dispatcher.StateDone:
		return 0, fmt.Errorf("request %s: %w", rec.ID, dispatcher.ErrDuplicate)
	case old.Live() && !old.Deadline.Before(time.Now()) && s.liveness.Alive(ctx, old.Gateway):
		return 0, fmt.Errorf("request %s: %w", rec.ID, dispatcher.ErrDuplicate)
	}
	rec.Generation = old.Generation + 1
	rec.Replays = old.Replays
	rev, err = s.records.Update(ctx, rec, rev)
	if err != nil {
		if dispatcher.IsWrongRevision(err) {
			return 0, fmt.Errorf("request %s: %w", rec.ID, dispatcher.ErrDuplicate) // another retry won
		}
		return 0, fmt.Errorf("record %s: %w", rec.ID, err)
	}
	return rev, nil
}
