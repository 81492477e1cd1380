package admin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/internal/sleep"
)

// Errors of [Replayer.Replay] for a request that is not run again.
var (
	// ErrSucceeded means the request has delivered since it failed.
	ErrSucceeded = errors.New("the request has succeeded since; not replaying it")
	// ErrLive means the request is running (a retry or another replay).
	ErrLive = errors.New("the request is in flight; not replaying it")
	// ErrNoDeadLetter means the dead-letter stream holds nothing for the id.
	ErrNoDeadLetter = errors.New("no dead letter for this request")
)

// Replayer runs failed requests again from the dead-letter stream.
type Replayer struct {
	js      jetstream.JetStream
	records *dispatcher.Records
	// Timeout is the fresh deadline of a replayed request.
	Timeout time.Duration
}

// NewReplayer opens the dead-letter stream and the request records.
func NewReplayer(ctx context.Context, js jetstream.JetStream, timeout time.Duration) (*Replayer, error) {
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		return nil, err
	}
	return &Replayer{js: js, records: records, Timeout: timeout}, nil
}

// DeadLetter is one entry of the dead-letter stream.
type DeadLetter struct {
	ID     string
	Pool   string
	Stage  dispatcher.Stage
	Reason string
	Time   time.Time
	seq    uint64
	msg    *jetstream.RawStreamMsg
}

// DeadLetters lists the entries stored since the given time (all for the
// zero time), oldest first.
func (rp *Replayer) DeadLetters(ctx context.Context, since time.Time) ([]DeadLetter, error) {
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{dispatcher.SubjectDLQ + ".>"}}
	if !since.IsZero() {
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &since
	}
	st, err := rp.js.Stream(ctx, dispatcher.StreamDLQ)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dispatcher.StreamDLQ, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", dispatcher.StreamDLQ, err)
	}
	if info.State.Msgs == 0 {
		return nil, nil
	}
	cons, err := st.OrderedConsumer(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", dispatcher.StreamDLQ, err)
	}
	var out []DeadLetter
	for {
		batch, err := cons.FetchNoWait(256)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", dispatcher.StreamDLQ, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			meta, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			dl, err := rp.load(ctx, st, meta.Sequence.Stream)
			if err == nil {
				out = append(out, dl)
			}
			if meta.NumPending == 0 {
				return out, batch.Error()
			}
		}
		if err := batch.Error(); err != nil {
			return nil, fmt.Errorf("read %s: %w", dispatcher.StreamDLQ, err)
		}
		if n == 0 {
			return out, nil
		}
	}
}

func (rp *Replayer) load(ctx context.Context, st jetstream.Stream, seq uint64) (DeadLetter, error) {
	m, err := st.GetMsg(ctx, seq)
	if err != nil {
		return DeadLetter{}, err
	}
	return DeadLetter{
		ID: m.Header.Get(dispatcher.HeaderID), Pool: m.Header.Get(dispatcher.HeaderPool), Stage: dispatcher.Stage(m.Header.Get(dispatcher.HeaderStage)),
		Reason: m.Header.Get(dispatcher.HeaderReason), Time: m.Time, seq: m.Sequence, msg: m,
	}, nil
}

// Find returns the dead letter of request id.
func (rp *Replayer) Find(ctx context.Context, id string) (DeadLetter, error) {
	keys := dispatcher.LookupKeys(id)
	if len(keys) == 0 {
		return DeadLetter{}, fmt.Errorf("%q is not a valid request id", id)
	}
	st, err := rp.js.Stream(ctx, dispatcher.StreamDLQ)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("open %s: %w", dispatcher.StreamDLQ, err)
	}
	var first error
	for i, key := range keys {
		dl, err := rp.find(ctx, st, key)
		if err == nil {
			return dl, nil
		}
		if i == 0 {
			first = err
		}
	}
	return DeadLetter{}, first
}

// find is Find of the request recorded under key.
func (rp *Replayer) find(ctx context.Context, st jetstream.Stream, id string) (DeadLetter, error) {
	if r, _, err := rp.records.Get(ctx, id); err == nil {
		if m, err := st.GetLastMsgForSubject(ctx, dispatcher.DLQSubject(r.Pool, id)); err == nil {
			return rp.load(ctx, st, m.Sequence)
		}
	}
	// No record (older than its TTL): look for the id in any pool.
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{dispatcher.SubjectDLQ + ".*." + id}, DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return DeadLetter{}, err
	}
	batch, err := cons.FetchNoWait(1)
	if err != nil {
		return DeadLetter{}, err
	}
	m, ok := <-batch.Messages() // one at most: the latest for the id
	if !ok {
		return DeadLetter{}, fmt.Errorf("%s: %w", id, ErrNoDeadLetter)
	}
	meta, err := m.Metadata()
	if err != nil {
		return DeadLetter{}, err
	}
	return rp.load(ctx, st, meta.Sequence.Stream)
}

// Replay runs a dead letter's request again as its next generation, with
// a fresh deadline and no client: its answer is kept in its record. The
// dead letter is removed once the new job is queued. Replay is
// idempotent: a request that is in flight or has succeeded is refused.
func (rp *Replayer) Replay(ctx context.Context, dl DeadLetter) (generation int, err error) {
	job, err := dispatcher.ParseJob(dl.msg.Header, dl.msg.Data)
	if err != nil {
		return 0, fmt.Errorf("dead letter of %s: %w", dl.ID, err)
	}
	now := time.Now()
	stage := dispatcher.StagePrefill
	rec, err := rp.records.Transition(ctx, job.ID, func(r *dispatcher.Record) error {
		switch {
		case r.State == dispatcher.StateDone:
			return ErrSucceeded
		case r.Live():
			return ErrLive
		}
		if r.DecodeOnly {
			stage = dispatcher.StageDecode
		}
		r.State, r.Generation, r.Error, r.Result, r.Stages = dispatcher.StateQueued, r.Generation+1, nil, nil, nil
		r.Gateway, r.Deadline = "", now.Add(rp.Timeout)
		r.Replays++
		return nil
	})
	if errors.Is(err, dispatcher.ErrNoRecord) {
		rec = &dispatcher.Record{ID: job.ID, State: dispatcher.StateQueued, Generation: job.Generation + 1, Model: job.Model, Pool: job.Pool,
			Endpoint: job.Endpoint, Stream: job.Stream, Owner: job.Owner, Created: now, Updated: now, Deadline: now.Add(rp.Timeout), Replays: 1}
		_, err = rp.records.Create(ctx, rec)
		if dispatcher.IsWrongRevision(err) {
			err = ErrLive // created by a replay running beside this one
		}
	}
	if err != nil {
		return 0, err
	}
	job.Generation, job.ReplyTo, job.Deadline, job.Submitted = rec.Generation, "", rec.Deadline, now
	job.KV, job.Prefill, job.RecordRevision = nil, nil, 0 // a dead letter keeps the revision it was queued under
	job.Prefer, job.PreferDecode = "", ""                 // its engines may be long gone: any worker
	// A replay starts from the client's body, not from where a migrated
	// decode had got to.
	job.Resume, job.Sent, job.HandBacks = nil, nil, 0
	if err := dispatcher.PublishGeneration(ctx, rp.js, rp.records, job, stage); err != nil {
		if rerr := rp.records.End(context.WithoutCancel(ctx), job.ID, job.Generation, dispatcher.StateFailed,
			&dispatcher.RecordError{Status: 503, Message: "replay could not queue the request: " + err.Error()}); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return 0, err
	}
	// The dead letter may be gone already: the replayed generation, failed
	// again, put its own in its place.
	st, err := rp.js.Stream(ctx, dispatcher.StreamDLQ)
	if err == nil {
		err = dispatcher.DeleteMsg(ctx, st, dl.seq)
	}
	if err != nil {
		return job.Generation, fmt.Errorf("queued, but the dead letter stays: %w", err)
	}
	return job.Generation, nil
}

// WaitAll waits until the records of ids end, or ctx does, calling ended
// with each as it ends, in the order they end, and idle each time a period
// has passed without one ending (for a progress line).
func (rp *Replayer) WaitAll(ctx context.Context, ids []string, period time.Duration, ended func(*dispatcher.Record), idle func(left int)) error {
	left := slices.Clone(ids)
	last := time.Now()
	for len(left) > 0 {
		before := len(left)
		var err error
		left = slices.DeleteFunc(left, func(id string) bool {
			if err != nil {
				return false
			}
			var r *dispatcher.Record
			if r, _, err = rp.records.Get(ctx, id); err != nil || !r.State.Ended() {
				return false
			}
			ended(r)
			return true
		})
		if err != nil {
			return err
		}
		switch {
		case len(left) < before:
			last = time.Now()
		case time.Since(last) >= period:
			idle(len(left))
			last = time.Now()
		}
		if len(left) > 0 {
			if err := sleep.For(ctx, 100*time.Millisecond); err != nil {
				return err
			}
		}
	}
	return nil
}

// Wait waits until id's record ends, or ctx does, and returns it.
func (rp *Replayer) Wait(ctx context.Context, id string) (*dispatcher.Record, error) {
	var rec *dispatcher.Record
	err := rp.WaitAll(ctx, []string{id}, time.Hour, func(r *dispatcher.Record) { rec = r }, func(int) {})
	return rec, err
}
