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

// Errors of a publish, and of the submit that claims an id for it.
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

// NoAnswer reports whether a NATS call failed for want of an answer, not
// because it was refused: it may have been carried out.
func NoAnswer(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders)
}

// PublishGeneration stores a job its record has just claimed. The record's
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

// Publish stores msg on its stream, deduplicated by its Nats-Msg-Id.
func Publish(ctx context.Context, js jetstream.Publisher, msg *nats.Msg) error {
	_, err := PublishSeq(ctx, js, msg)
	return err
}

// Publishing across a failover. A stream has no leader for seconds after
// its leader's node is lost (nats-server elects a new one 4 to 9 s after
// the last heartbeat): a publish meanwhile finds no responders, and one
// sent to the dying leader is never answered. Either way the message was
// not acknowledged, so it is sent again, each attempt bounded by
// publishAttempt, for up to PublishFailover in all (or until ctx ends),
// instead of failing after the client's default half second of retries
// or waiting out a 5 s time-out on the first attempt. A message whose
// lost attempt was stored after all comes back as a duplicate, as it
// would on any retry: every message published here has a Nats-Msg-Id.
const (
	PublishAttempt    = 2 * time.Second
	publishRetryWait  = 250 * time.Millisecond
	PublishFailover   = 15 * time.Second
	publishNoLeaderTo = int(PublishAttempt / publishRetryWait)
)

// PublishSeq is publish that also returns the message's stream sequence
// (for a duplicate, the earlier message's).
func PublishSeq(ctx context.Context, js jetstream.Publisher, msg *nats.Msg) (uint64, error) {
	giveUp := time.Now().Add(PublishFailover)
	silent, last := 0, uint64(0) // unanswered attempts in a row; the stream's last sequence at the first
	for {
		actx, cancel := context.WithTimeout(ctx, PublishAttempt)
		ack, err := js.PublishMsg(actx, msg, jetstream.WithRetryWait(publishRetryWait), jetstream.WithRetryAttempts(publishNoLeaderTo))
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
			seq, ok := AnswersAbout(ctx, js, msg.Subject)
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
// is sent: its store latched a write error (a full disk; see dispatcher/admin/doctor.go).
// Trying again does not help until the stream is rebuilt.
var ErrNotStoring = errors.New("the stream does not store (its disk may be full)")

// AnswersAbout reports whether the stream that stores subject answers
// about itself, within a second, and its last sequence. Only a stream of
// one replica counts: one of several whose leader stops answering hands
// over to another replica (a store that latched a write error steps
// down), and what looks like not storing is a failover.
func AnswersAbout(ctx context.Context, js jetstream.Publisher, subject string) (last uint64, ok bool) {
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
