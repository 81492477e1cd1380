package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrDLQFull means the dead-letter stream refused an entry: it is full.
var ErrDLQFull = errors.New("the dead-letter stream is full")

// DeadLetterJob keeps a request that the gateway failed on the way back
// (its decode restarted after output, its reply lost or silent) for
// replay, as a worker keeps the jobs it fails: its job as the gateway
// queued it, the client's body and all.
func DeadLetterJob(ctx context.Context, js jetstream.Publisher, job *Job, stage Stage, status int, reason string, metrics *Metrics) error {
	m := job.Msg(stage)
	m.Subject = DLQSubject(job.Pool, job.ID)
	return StoreDeadLetter(ctx, js, m, job.ID, stage, status, reason, metrics)
}

// StoreDeadLetter labels m, a job's message as it was, with the stage,
// status and reason of its failure, and stores it in the dead-letter
// stream at its subject, once per generation.
func StoreDeadLetter(ctx context.Context, js jetstream.Publisher, m *nats.Msg, id string, stage Stage, status int, reason string, metrics *Metrics) error {
	m.Header[HeaderStage] = []string{string(stage)}
	m.Header[HeaderStatus] = []string{strconv.Itoa(status)}
	m.Header[HeaderReason] = []string{reason[:min(len(reason), 1024)]}
	m.Header[nats.MsgIdHdr] = []string{id + "/dlq/" + m.Header.Get(HeaderGeneration)}
	// As any job's publish: across a failover, and refused by a full
	// stream or one whose store does not write (a full disk, and PDQ_DLQ
	// is not rebuilt: until NATS restarts).
	_, err := PublishSeq(ctx, js, m)
	switch {
	case errors.Is(err, ErrDuplicate):
		return nil // counted when it was stored
	case errors.Is(err, ErrQueueFull), errors.Is(err, ErrNotStoring):
		metrics.deadLetterRefused(stage)
		return fmt.Errorf("%w (%d entries or %d bytes, or its store does not write): %w", ErrDLQFull, dlqMaxMsgs, dlqMaxBytes, err)
	case err != nil:
		return err
	}
	metrics.deadLetter(stage)
	return nil
}
