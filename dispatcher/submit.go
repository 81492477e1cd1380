package dispatcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// Errors of [Submitter.Submit].
var (
	// ErrDuplicate means JetStream has seen this request id within its
	// dedup window: the job was not queued again.
	ErrDuplicate = errors.New("a request with this id was already accepted")
	// ErrQueueFull means the stage's stream is at its bound. Nothing queued
	// was dropped to make room.
	ErrQueueFull = errors.New("the job queue is full")
)

// JetStream API error codes that mean a bounded stream or account is full.
const (
	errCodeStoreFailed           = 10077
	errCodeInsufficientResources = 10023
)

// Submitter publishes jobs for the gateway.
type Submitter struct {
	js jetstream.Publisher
}

// NewSubmitter returns a Submitter that publishes with js.
func NewSubmitter(js jetstream.Publisher) *Submitter { return &Submitter{js: js} }

// Submit queues job for stage, with the request id as Nats-Msg-Id, and
// returns once JetStream has stored it.
func (s *Submitter) Submit(ctx context.Context, stage Stage, job *Job) error {
	if err := job.Validate(); err != nil {
		return err
	}
	return publishJob(ctx, s.js, stage, job, job.ID)
}

// publishJob stores job on stage's stream, deduplicated by msgID.
func publishJob(ctx context.Context, js jetstream.Publisher, stage Stage, job *Job, msgID string) error {
	data, err := json.Marshal(job)
	if err != nil {
		return fmt.Errorf("encode job %s: %w", job.ID, err)
	}
	subject := JobSubject(stage, job.Pool, job.ID)
	ack, err := js.Publish(ctx, subject, data, jetstream.WithMsgID(msgID))
	if err != nil {
		if isFull(err) {
			return fmt.Errorf("publish %s: %w: %w", subject, ErrQueueFull, err)
		}
		return fmt.Errorf("publish %s: %w", subject, err)
	}
	if ack.Duplicate {
		return fmt.Errorf("publish %s: %w", subject, ErrDuplicate)
	}
	return nil
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
