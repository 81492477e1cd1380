package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Failure classifies a handler's error for the ack policy.
type Failure struct {
	Err error
	// Permanent failures go to the client at once; others are retried on
	// a later delivery, possibly on another worker, until MaxDeliver.
	Permanent bool
	// Reported means the handler already ended the client's reply (an
	// in-stream error); the loop sends nothing more.
	Reported bool
	// Client is what the client gets when this failure is the last word.
	Client *openai.Error
}

func (f *Failure) Error() string { return f.Err.Error() }
func (f *Failure) Unwrap() error { return f.Err }

// Permanent marks err as not worth retrying; client is what the client
// gets, typically the engine's own 4xx.
func Permanent(err error, client *openai.Error) error {
	return &Failure{Err: err, Permanent: true, Client: client}
}

// Retryable marks err as transient; client is what the client gets if no
// attempt succeeds.
func Retryable(err error, client *openai.Error) error {
	return &Failure{Err: err, Client: client}
}

// Reported marks err as already told to the client.
func Reported(err error) error {
	return &Failure{Err: err, Permanent: true, Reported: true}
}

// DefaultRetryBase is the first retry's delay; each next one is 4 times
// longer: 250ms, 1s, 4s.
const DefaultRetryBase = 250 * time.Millisecond

// retryDelay is the NakWithDelay back-off, capped at 10s. A plain Nak would
// redeliver at once and storm an engine that is down.
func retryDelay(base time.Duration, attempt int) time.Duration {
	d := base
	for i := 1; i < attempt; i++ {
		d *= 4
	}
	return min(d, 10*time.Second)
}

// Handler runs one job of a stage. A nil error acks the job; see
// [Failure] for the rest. The handler must return when ctx ends.
type Handler func(ctx context.Context, d *Delivery) error

// Delivery is one delivery of a job to a handler.
type Delivery struct {
	Job *Job
	// Attempt counts deliveries of this job, from 1.
	Attempt int
	loop    *StageLoop
}

// Forward hands the job on to the next stage and returns once JetStream
// has stored it, so the current stage can be acked. A republish after a
// crash is recognized as a duplicate and counts as done.
func (d *Delivery) Forward(ctx context.Context, stage Stage, job *Job) error {
	err := publishJob(ctx, d.loop.js, stage, job, job.ID+"/"+string(stage))
	if errors.Is(err, ErrDuplicate) {
		return nil
	}
	return err
}

// Replies writes the client's reply for this delivery.
func (d *Delivery) Replies() *ReplyWriter {
	return d.loop.replies(d.Job, d.Attempt)
}

// replies writes job's reply. Decode deliveries number their replies by
// attempt, so a redelivered decode starts a new reply; prefill errors are
// attempt 0.
func (l *StageLoop) replies(job *Job, attempt int) *ReplyWriter {
	if l.cfg.Stage != StageDecode {
		attempt = 0
	}
	return NewReplyWriter(l.nc, job.ReplyTo, attempt)
}

// StageConfig configures a [StageLoop].
type StageConfig struct {
	Stage Stage
	Pool  string
	// Slots is how many jobs run at once: the engine's concurrency. A job
	// is pulled only when a slot is free.
	Slots   int
	Handler Handler
	// Worker describes the worker in the registry; its Role, Pool and Slots
	// are filled in from this config.
	Worker WorkerInfo
	// Grace is how long in-flight jobs may run on after Run's context ends;
	// the rest are handed back for redelivery.
	Grace time.Duration
	// RetryBase is the delay before the first retry of a failed job;
	// 0 takes DefaultRetryBase.
	RetryBase time.Duration
	// AckWait is the consumer's ack wait; 0 takes DefaultAckWait. All
	// workers of a pool should agree on it.
	AckWait time.Duration
}

// StageLoop pulls jobs of one stage and pool and runs them.
type StageLoop struct {
	cfg StageConfig
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger

	inFlight atomic.Int64
	mu       sync.Mutex
	cancels  map[string]context.CancelCauseFunc
}

// errCancelled is the cause of a job cancelled by its client.
var errCancelled = errors.New("cancelled by the client")

// NewStageLoop builds a loop; Run starts it.
func NewStageLoop(nc *nats.Conn, js jetstream.JetStream, cfg StageConfig, log *slog.Logger) (*StageLoop, error) {
	if cfg.Stage != StagePrefill && cfg.Stage != StageDecode {
		return nil, fmt.Errorf("stage loop: unknown stage %q", cfg.Stage)
	}
	if cfg.Pool == "" || cfg.Slots < 1 || cfg.Handler == nil {
		return nil, fmt.Errorf("stage loop: pool, slots >= 1 and a handler are required")
	}
	if cfg.Grace <= 0 {
		cfg.Grace = 30 * time.Second
	}
	if cfg.RetryBase <= 0 {
		cfg.RetryBase = DefaultRetryBase
	}
	if cfg.AckWait <= 0 {
		cfg.AckWait = DefaultAckWait
	}
	cfg.Worker.Role, cfg.Worker.Pool, cfg.Worker.Slots = cfg.Stage, cfg.Pool, cfg.Slots
	return &StageLoop{
		cfg: cfg, nc: nc, js: js,
		log:     log.With("stage", string(cfg.Stage), "pool", cfg.Pool),
		cancels: make(map[string]context.CancelCauseFunc),
	}, nil
}

// InFlight is the number of jobs running now.
func (l *StageLoop) InFlight() int { return int(l.inFlight.Load()) }

// Run pulls and runs jobs until ctx ends, then lets running jobs finish
// within the grace period and hands the rest back.
func (l *StageLoop) Run(ctx context.Context) error {
	cons, err := EnsureConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait)
	if err != nil {
		return err
	}
	cancelSub, err := l.nc.Subscribe(CancelSubject("*"), l.onCancel)
	if err != nil {
		return fmt.Errorf("subscribe to cancels: %w", err)
	}
	defer cancelSub.Unsubscribe()

	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		l.heartbeat(ctx)
	}()

	// Jobs outlive ctx by the grace period, so a shutdown does not abort
	// engine calls that are about to finish.
	jobCtx, stopJobs := context.WithCancel(context.WithoutCancel(ctx))
	defer stopJobs()
	slots := make(chan struct{}, l.cfg.Slots)
	var wg sync.WaitGroup
	l.log.Info("stage worker pulling", "slots", l.cfg.Slots, "consumer", ConsumerName(l.cfg.Stage, l.cfg.Pool))
pull:
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			break pull
		}
		msg, err := cons.Next(jetstream.FetchContext(ctx))
		if err != nil {
			<-slots
			if ctx.Err() != nil {
				break pull
			}
			if errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrNoMessages) {
				continue
			}
			l.log.Warn("pull failed; retrying in 1s", logging.Err(err))
			if sleepCtx(ctx, time.Second) != nil {
				break pull
			}
			if c, err := EnsureConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait); err == nil {
				cons = c
			}
			continue
		}
		l.inFlight.Add(1)
		wg.Go(func() {
			defer func() {
				l.inFlight.Add(-1)
				<-slots
			}()
			l.process(jobCtx, msg)
		})
	}

	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	if n := l.InFlight(); n > 0 {
		l.log.Info("stopping: waiting for running jobs", "in_flight", n, "grace", l.cfg.Grace.String())
	}
	select {
	case <-done:
	case <-time.After(l.cfg.Grace):
		l.log.Warn("grace period over: handing running jobs back for redelivery", "in_flight", l.InFlight())
		stopJobs()
		<-done
	}
	<-hbDone
	l.log.Info("stage worker stopped")
	return nil
}

func (l *StageLoop) process(ctx context.Context, msg jetstream.Msg) {
	attempt := 1
	if meta, err := msg.Metadata(); err == nil {
		attempt = int(meta.NumDelivered)
	}
	job, err := decodeJob(msg.Data())
	if err != nil {
		// A message nobody can read cannot be answered either: keep it in
		// the dead-letter stream and drop it from the queue.
		l.log.Error("dropping a job that is not a valid envelope", logging.Err(err), "subject", msg.Subject())
		l.deadLetter(ctx, "", "", msg.Data(), err.Error())
		l.term(msg, "invalid envelope")
		return
	}
	log := l.log.With(logging.KeyRequestID, job.ID, "attempt", attempt)
	jctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	l.mu.Lock()
	l.cancels[job.ID] = cancel
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.cancels, job.ID)
		l.mu.Unlock()
	}()

	stopProgress := l.keepAlive(jctx, msg)
	start := time.Now()
	err = l.cfg.Handler(jctx, &Delivery{Job: job, Attempt: attempt, loop: l})
	stopProgress()

	actx, acancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer acancel()
	switch {
	case err == nil:
		if err := msg.DoubleAck(actx); err != nil {
			// The job will be redelivered and run again; the next stage's
			// publish is deduplicated.
			log.Warn("ack failed; the job will be redelivered", logging.Err(err))
		}
		log.Debug("job done", logging.Ms("duration_ms", time.Since(start)))
	case errors.Is(context.Cause(jctx), errCancelled):
		log.Info("job cancelled by its client", logging.Ms("duration_ms", time.Since(start)))
		l.term(msg, "cancelled by the client")
	case ctx.Err() != nil:
		log.Warn("job interrupted by shutdown; handing it back", logging.Err(err))
		if err := msg.Nak(); err != nil {
			log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
		}
	default:
		l.fail(actx, msg, job, attempt, err, log)
	}
}

// fail retries a job later, or ends it: the client gets the error, the job
// goes to the dead-letter stream, and the queue drops it.
func (l *StageLoop) fail(ctx context.Context, msg jetstream.Msg, job *Job, attempt int, err error, log *slog.Logger) {
	var f *Failure
	if !errors.As(err, &f) {
		f = &Failure{Err: err}
	}
	if !f.Permanent && attempt < MaxDeliver {
		delay := retryDelay(l.cfg.RetryBase, attempt)
		log.Warn("job failed; retrying", logging.Err(err), "retry_in", delay.String())
		if err := msg.NakWithDelay(delay); err != nil {
			log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(err))
		}
		return
	}
	client := f.Client
	if client == nil {
		client = openai.NewError(http.StatusBadGateway, "%s failed: %v", l.cfg.Stage, err)
	}
	if !f.Permanent {
		client = openai.NewError(client.Status(), "%s (after %d attempts)", client.Message, attempt)
	}
	log.Error("job failed for good", logging.Err(err), "status", client.Status(), "permanent", f.Permanent)
	if !f.Reported {
		if err := l.replies(job, attempt).Error(client); err != nil {
			log.Warn("could not send the error to the gateway", logging.Err(err))
		}
	}
	l.deadLetter(ctx, job.Pool, job.ID, msg.Data(), err.Error())
	l.term(msg, client.Message)
}

// deadLetter keeps a failed job for replay. WorkQueue streams delete a
// terminated message, so it is copied first.
func (l *StageLoop) deadLetter(ctx context.Context, pool, id string, data []byte, reason string) {
	if pool == "" {
		pool = l.cfg.Pool
	}
	if id == "" {
		id = "invalid-" + randomID()
	}
	m := nats.NewMsg(DLQSubject(pool, id))
	m.Header.Set(HeaderStage, string(l.cfg.Stage))
	m.Header.Set(HeaderReason, truncate(reason, 1024))
	m.Data = data
	if _, err := l.js.PublishMsg(ctx, m); err != nil {
		l.log.Error("could not keep a failed job in the dead-letter stream", logging.KeyRequestID, id, logging.Err(err))
	}
}

func (l *StageLoop) term(msg jetstream.Msg, reason string) {
	if err := msg.TermWithReason(truncate(reason, 256)); err != nil {
		l.log.Warn("term failed; the job may be redelivered", logging.Err(err))
	}
}

// keepAlive tells JetStream the job is still running, every third of the
// ack wait,
// until stopped.
func (l *StageLoop) keepAlive(ctx context.Context, msg jetstream.Msg) (stop func()) {
	kctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(l.cfg.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-kctx.Done():
				return
			case <-t.C:
				if err := msg.InProgress(); err != nil {
					l.log.Warn("in-progress signal failed", logging.Err(err))
				}
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

func (l *StageLoop) onCancel(msg *nats.Msg) {
	id := msg.Subject[len(CancelSubject("")):]
	l.mu.Lock()
	cancel := l.cancels[id]
	l.mu.Unlock()
	if cancel != nil {
		cancel(errCancelled)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
