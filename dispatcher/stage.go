package dispatcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
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
	// A 4xx is the client's own mistake: it is answered and recorded, not
	// dead-lettered.
	Client *openai.Error
	// Rejected means the engine refused the request before running it, so
	// a handoff's KV blocks were never read and must be released.
	Rejected bool
	// HandBack means the job never reached an engine: it goes back to the
	// queue for another worker, as the same generation, with no delivery
	// counted against it.
	HandBack bool
	// Unread means a decode engine never ran the request: a handoff's KV
	// was not read, and is released when the request goes back to
	// prefill.
	Unread bool
}

func (f *Failure) Error() string { return f.Err.Error() }
func (f *Failure) Unwrap() error { return f.Err }

// Permanent marks err as not worth retrying; client is what the client
// gets.
func Permanent(err error, client *openai.Error) error {
	return &Failure{Err: err, Permanent: true, Client: client}
}

// Rejected marks err as the engine's refusal of the request (its 4xx):
// permanent, the client's, and the engine never ran it.
func Rejected(err error, client *openai.Error) error {
	return &Failure{Err: err, Permanent: true, Client: client, Rejected: true}
}

// Retryable marks err as transient; client is what the client gets if no
// attempt succeeds.
func Retryable(err error, client *openai.Error) error {
	return &Failure{Err: err, Client: client}
}

// HandBack returns a job that never reached this worker's engine to the
// queue for another worker (one whose engine is healthy); client is what
// the client gets if it can go nowhere.
func HandBack(err error, client *openai.Error) error {
	return &Failure{Err: err, Client: client, HandBack: true}
}

// Unread marks err, a decode's failure, as one whose engine never ran the
// request (it refused the connection, or answered before running it), so
// that the handoff's KV, unread, is released when the request goes back
// to prefill.
func Unread(err error) error {
	var f *Failure
	if !errors.As(err, &f) {
		return &Failure{Err: err, Unread: true}
	}
	unread := *f
	unread.Unread = true
	return &unread
}

// maxHandBacks bounds how often one job is handed back, should every
// worker keep handing it on.
const maxHandBacks = 8

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

// Defaults of the lifecycle settings in [StageConfig].
const (
	// DefaultKVTTL is how old a handoff may be when a decode worker pulls
	// it; older ones go back to prefill. It is under vLLM's 30 s KV lease.
	DefaultKVTTL = 25 * time.Second
	// DefaultMaxGenerations bounds the prefills one request may start.
	DefaultMaxGenerations = 3
	// DefaultStallTimeout bounds a decode's silence: the engine's, between
	// chunks, and the worker's, between heartbeats to the gateway.
	DefaultStallTimeout = 30 * time.Second
	// DefaultPrefillTimeout bounds a prefill engine's answer.
	DefaultPrefillTimeout = 60 * time.Second
	// minUsefulTime is the least time before its deadline that a job must
	// have left when it is pulled: with less, no engine could answer before
	// the gateway gives up, and a burst of jobs submitted together would
	// each start an engine call only to be cancelled a moment later.
	minUsefulTime = 100 * time.Millisecond
	// maxRecordResult bounds a replay's answer kept in its record, under
	// the bucket's value limit.
	maxRecordResult = 4 << 20
	// dlqRetry is how long a job whose dead letter could not be stored
	// waits in its queue before it tries again.
	dlqRetry = 30 * time.Second
)

// Handler runs one job of a stage. A nil error acks the job; see
// [Failure] for the rest. The handler must return when ctx ends.
type Handler func(ctx context.Context, d *Delivery) error

// Delivery is one delivery of a job to a handler.
type Delivery struct {
	Job *Job
	// Attempt counts deliveries of this job in its generation, from 1.
	Attempt int
	loop    *StageLoop
	replies *ReplyWriter
	handoff *Job
	moved   *Job
	// movedFrom is the engine's failure that made the handler migrate.
	movedFrom error
	// ctx and stopBeats run a decode's heartbeats from its first use of
	// Replies to the handler's return.
	ctx       context.Context
	stopBeats func()
	permit    uint64
	// stop ends the job's context, as a cancel broadcast does.
	stop context.CancelCauseFunc
}

// Permit is the token of the permit StageConfig.Ready granted this
// delivery's pull (0 without Ready).
func (d *Delivery) Permit() uint64 { return d.permit }

// Migrate is how a decode handler that failed after output hands the rest
// of the answer on: sent is the text the client has been sent, all
// generations together, from which the next decode continues the
// client's body; resume says what else the client has, and cause is the
// engine's failure. The loop queues it as the next generation, on any
// decode engine, before it acks this job. The handler must have sent
// Moved on its reply first.
func (d *Delivery) Migrate(sent []byte, resume Resume, cause error) {
	d.movedFrom = cause
	next := *d.Job
	resume.Original = true
	next.Sent, next.KV, next.Prefill, next.Resume = sent, nil, nil, &resume
	next.Generation = d.Job.Generation + 1
	// A new job: the hand-backs of the one it continues do not count
	// against its own (a worker hands on a continuation from the engine
	// it broke on a bounded number of times).
	next.HandBacks = 0
	d.moved = &next
}

// HandOff is how a prefill handler returns its result: the job for the
// decode stage, with kv, which the loop stores before it acks the prefill.
// A failed store is retried as a store; the prefill is never run again
// for it.
func (d *Delivery) HandOff(kv json.RawMessage, rec StageRecord) {
	h := *d.Job
	h.KV, h.Prefill = kv, &rec
	d.handoff = &h
}

// Forward sends the job on to the decode stage without a prefill: the
// decode engine prefills the prompt itself. It is the fallback of a
// prefill worker whose engine is down while no other is healthy.
func (d *Delivery) Forward() {
	h := *d.Job
	h.KV, h.Prefill = nil, nil
	d.handoff = &h
}

// Forwarded reports whether Forward was called.
func (d *Delivery) Forwarded() bool {
	return d.handoff != nil && len(d.handoff.KV) == 0 && d.handoff.Prefill == nil
}

// Moved reports whether Migrate was called.
func (d *Delivery) Moved() bool { return d.moved != nil }

// MovedFrom is the failure a migrated delivery moved away from.
func (d *Delivery) MovedFrom() error { return d.movedFrom }

// Replies writes the client's reply for this delivery. A decode's first
// call starts its heartbeats: from then on the gateway knows the decode
// runs, and which chunks it lacks, even while the engine is silent.
func (d *Delivery) Replies() *ReplyWriter {
	if d.replies == nil {
		d.replies = d.loop.replies(d.Job, d.Attempt)
		if d.loop.cfg.Stage == StageDecode && d.ctx != nil {
			d.replies.Watch(d.stop, d.loop.wanted(d.Job))
			d.stopBeats = d.replies.Beats(d.ctx, beatEvery(d.loop.cfg.StallTimeout))
		}
	}
	return d.replies
}

// sent is the number of chunks this delivery sent to the client.
func (d *Delivery) sent() int {
	if d.replies == nil {
		return 0
	}
	return d.replies.Own()
}

// replies writes job's reply. Decode deliveries are ordered by generation
// and delivery, so a later one starts a new reply; prefill errors are
// delivery 0 of their generation.
func (l *StageLoop) replies(job *Job, attempt int) *ReplyWriter {
	if job.Rebuilt {
		attempt += rebuiltReplies
	}
	if l.cfg.Stage != StageDecode {
		attempt = 0
	}
	w := NewReplyWriter(l.nc, job.ReplyTo, ReplyAttempt(job.Generation, attempt))
	if job.ReplyFramed {
		w.Frame()
		w.Local(l.cfg.LocalReplies)
	}
	if job.Resume != nil && l.cfg.Stage == StageDecode {
		w.ContinueAt(job.Resume.Chunks)
	}
	w.SetEndWait(min(l.cfg.StallTimeout, DefaultEndWait))
	return w
}

// beatEvery is how often a running decode beats to its gateway: five times
// within the stall time-out, so a few lost beats do not fail a request.
func beatEvery(stall time.Duration) time.Duration {
	return min(max(stall/5, 100*time.Millisecond), 2*time.Second)
}

// StageConfig configures a [StageLoop].
type StageConfig struct {
	Stage Stage
	Pool  string
	// Slots is how many jobs run at once: the engine's concurrency. A job
	// is pulled only when a slot is free.
	Slots int
	// EngineSlots, when set, are the engine's slots, shared with the loops
	// of the engine's other models (see [EngineSlots]).
	EngineSlots *EngineSlots
	Handler     Handler
	// Release frees the prefill engine's KV blocks of a handoff that will
	// not be decoded (cancelled, expired, superseded, too old, rejected by
	// the engine). Decode stages set it; it is never called for a handoff
	// a decode engine may already have read.
	Release func(ctx context.Context, job *Job) error
	// Worker describes the worker in the registry; its Role, Pool and Slots
	// are filled in from this config.
	Worker WorkerInfo
	// Grace is how long in-flight jobs may run on after Run's context ends;
	// the rest are handed back for redelivery.
	Grace time.Duration
	// RetryBase is the delay before the first retry of a failed job;
	// 0 takes DefaultRetryBase.
	RetryBase time.Duration
	// PullWait is how long a pull waits on the server for a job; 0 takes
	// DefaultPullWait, and under 10 ms is refused. A loop that stops waits
	// for its pull to end (this long at most, while its server answers), so
	// that a job the server sends as it stops reaches it, to be given back,
	// rather than being dropped.
	PullWait time.Duration
	// AckWait is the consumer's ack wait; 0 takes DefaultAckWait. All
	// workers of a pool should agree on it.
	AckWait time.Duration
	// KeepEvery is how often a loop that takes jobs renews its stream's
	// keeper (see keeper.go); 0 takes DefaultKeepEvery.
	KeepEvery time.Duration
	// KVTTL is the oldest handoff a decode stage runs; 0 takes
	// DefaultKVTTL.
	KVTTL time.Duration
	// MaxGenerations bounds the prefills of one request; 0 takes
	// DefaultMaxGenerations.
	MaxGenerations int
	// MaxDeliver bounds the deliveries of one job; 0 takes
	// DefaultMaxDeliver.
	MaxDeliver int
	// StallTimeout is how long the gateway waits for a sign of a running
	// decode; 0 takes DefaultStallTimeout. A decode delivery beats well
	// within it, and waits at most this long (10 s at most) for the
	// gateway to acknowledge the end of a reply.
	StallTimeout time.Duration
	// Ready, when set, is called before each pull and returns when the
	// worker may take a job (its engine's breaker lets it). The handler
	// reads the permit's token back (Delivery.Permit); the loop releases
	// the permit when the pull got no job or the job never reached the
	// handler.
	Ready func(ctx context.Context) (Permit, error)
	// Health, when set, is the worker's breaker state for the registry, and
	// a channel closed at its next change, when the worker beats at once.
	Health func() (BreakerState, <-chan struct{})
	// Replicas is the replica count of the pdq_workers bucket, should
	// this loop find it missing and create it (PDQ_NATS_REPLICAS); 0 is 1.
	Replicas int
	// Metrics counts dead letters and KV releases; nil counts nothing.
	Metrics *Metrics
	// LocalReplies are the gateways in this process, which take replies
	// without NATS; nil sends every reply over NATS.
	LocalReplies *LocalReplies
}

// Permit is what StageConfig.Ready grants a pull.
type Permit struct {
	// Token is the handler's to read back, through Delivery.Permit.
	Token uint64
	// Release, if set, gives the permit back unused.
	Release func()
}

func (p Permit) release() {
	if p.Release != nil {
		p.Release()
	}
}

// StageLoop pulls jobs of one stage and pool and runs them.
//
// Run is called once; its goroutine pulls. Each job runs in a goroutine
// of its own (process, which calls the handler), and so do its keepAlive
// and its reply's beats, the keeper, heartbeat, watchGateways and
// sampleDepth, a decode stage's releaseLoop, and each direct release
// (releaseNow). onCancel and onRunning run on their subscriptions'
// goroutines. InFlight and Released may be called from any goroutine.
type StageLoop struct {
	// Set by NewStageLoop; cfg.AckWait, records and kvReads are set by Run
	// before it subscribes or starts a goroutine. Read without a lock.
	cfg     StageConfig
	nc      *nats.Conn
	js      jetstream.JetStream
	records *Records
	// kvReads claims handoffs' KV for one reader (decode stage only).
	kvReads  *kvReads
	liveness *Liveness
	log      *slog.Logger

	// Counters that the job and release goroutines change and the
	// heartbeat reads: atomics, so that neither takes mu. Run adds to
	// inFlight as it starts a job; the job's goroutine takes it away.
	inFlight   atomic.Int64
	released   atomic.Int64
	dlqRefused atomic.Int64
	durations  jobDurations // has its own lock

	// mu guards the fields below.
	mu      sync.Mutex
	running map[*runningJob]struct{}
	// reconnects and reconnectedAt track the connection's outages, for
	// the running query's wait.
	reconnects    uint64
	reconnectedAt time.Time
}

// runningJob is a job a slot is running, as the cancel broadcast and the
// gateway watch find it. Two deliveries of one id (two generations) may
// run at once: each has its own entry.
type runningJob struct {
	id         string
	gateway    string
	generation int
	origin     int
	attempt    int
	delivery   string // the settle's: which delivery this is
	cancel     context.CancelCauseFunc
}

// Causes of a job stopped while it runs.
var (
	errCancelled   = errors.New("cancelled by the client")
	errGatewayGone = errors.New("the gateway holding the client is gone")
	errExpired     = errors.New("the request's deadline passed")
	// errAbandoned stops a job whose gateway no longer holds its request,
	// or whose record says it ended: its cancel broadcast was lost.
	errAbandoned = errors.New("the gateway no longer holds the request")
	// errSuperseded stops a job whose request the gateway follows under a
	// later attempt: a redelivery of it, run while this worker was cut
	// off from NATS past the ack wait.
	errSuperseded = errors.New("a later attempt of the request runs")
)

// wanted says whether job's request still wants its work, by its record:
// not once the request has ended, moved on to a later generation, or been
// taken over. A record that cannot be read is no reason to stop.
func (l *StageLoop) wanted(job *Job) func(context.Context) bool {
	return func(ctx context.Context) bool {
		rec, _, err := l.records.Get(ctx, job.ID)
		if err != nil {
			return true
		}
		return !rec.State.Ended() && rec.Generation <= job.Generation && rec.Gateway == job.GatewayID()
	}
}

// NewStageLoop builds a loop; Run starts it.
func NewStageLoop(nc *nats.Conn, js jetstream.JetStream, cfg StageConfig, log *slog.Logger) (*StageLoop, error) {
	if cfg.Stage != StagePrefill && cfg.Stage != StageDecode {
		return nil, fmt.Errorf("stage loop: unknown stage %q", cfg.Stage)
	}
	if cfg.Pool == "" || cfg.Slots < 1 || cfg.Handler == nil {
		return nil, fmt.Errorf("stage loop: pool, slots >= 1 and a handler are required")
	}
	if cfg.Grace < 0 || cfg.RetryBase < 0 || cfg.AckWait < 0 || cfg.PullWait < 0 || cfg.KeepEvery < 0 || cfg.KVTTL < 0 || cfg.MaxGenerations < 0 || cfg.MaxDeliver < 0 || cfg.StallTimeout < 0 {
		return nil, fmt.Errorf("stage loop: durations and limits must not be negative")
	}
	if cfg.Grace == 0 {
		cfg.Grace = 30 * time.Second
	}
	if cfg.RetryBase == 0 {
		cfg.RetryBase = DefaultRetryBase
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = DefaultAckWait
	}
	if cfg.PullWait == 0 {
		cfg.PullWait = DefaultPullWait
	}
	if cfg.PullWait < minPullWait {
		return nil, fmt.Errorf("stage loop: a pull wait under %s would pull without a pause", minPullWait)
	}
	if cfg.KVTTL == 0 {
		cfg.KVTTL = DefaultKVTTL
	}
	if cfg.MaxGenerations == 0 {
		cfg.MaxGenerations = DefaultMaxGenerations
	}
	if cfg.MaxDeliver == 0 {
		cfg.MaxDeliver = DefaultMaxDeliver
	}
	if cfg.StallTimeout == 0 {
		cfg.StallTimeout = DefaultStallTimeout
	}
	cfg.Worker.Role, cfg.Worker.Pool, cfg.Worker.Slots = cfg.Stage, cfg.Pool, cfg.Slots
	return &StageLoop{
		cfg: cfg, nc: nc, js: js, liveness: NewLiveness(nc),
		log:     log.With("stage", string(cfg.Stage), "pool", cfg.Pool),
		running: make(map[*runningJob]struct{}),
	}, nil
}

// InFlight is the number of jobs running now.
func (l *StageLoop) InFlight() int { return int(l.inFlight.Load()) }

// recordDuration folds a finished job's duration into the average.
func (l *StageLoop) recordDuration(d time.Duration) { l.durations.add(d) }

func (l *StageLoop) avgJobMs() float64 { return l.durations.avgMs() }

// avgWarmup is how many jobs a loop finishes before it reports how long
// its jobs take: the first may be unlike the rest (a readiness probe of
// one token), and the decode gate lets prefills through on the report.
const avgWarmup = 8

// jobDurations averages how long a loop's jobs take: the plain mean of the
// first avgWarmup, then an exponential average that follows changes.
// The job goroutines call add as they end, the heartbeat avgMs.
type jobDurations struct {
	// mu guards the fields below.
	mu sync.Mutex
	n  int
	ms float64
}

func (j *jobDurations) add(d time.Duration) {
	ms := float64(d.Microseconds()) / 1000
	j.mu.Lock()
	defer j.mu.Unlock()
	j.n++
	if j.n <= avgWarmup {
		j.ms += (ms - j.ms) / float64(j.n)
		return
	}
	j.ms = 0.8*j.ms + 0.2*ms
}

// avgMs is the average in milliseconds, 0 until avgWarmup jobs finished.
func (j *jobDurations) avgMs() float64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.n < avgWarmup {
		return 0
	}
	return j.ms
}

// Released counts the handoffs whose KV blocks this loop released.
func (l *StageLoop) Released() int64 { return l.released.Load() }

// Run pulls and runs jobs until ctx ends, then lets running jobs finish
// within the grace period and hands the rest back.
func (l *StageLoop) Run(ctx context.Context) error {
	cons, err := EnsureConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait, WithLogger(l.log))
	if err != nil {
		return err
	}
	// The consumer's stored ack wait is the one in force (its first
	// creator's): running jobs signal progress by it.
	if aw := cons.CachedInfo().Config.AckWait; aw > 0 {
		l.cfg.AckWait = aw
	}
	if l.records, err = OpenRecords(ctx, l.js); err != nil {
		return err
	}
	if l.cfg.Stage == StageDecode {
		if l.kvReads, err = openKVReads(ctx, l.js); err != nil {
			return err
		}
	}
	var gate *decodeGate
	if l.cfg.Stage == StagePrefill {
		if gate, err = newDecodeGate(ctx, l.js, l.cfg.Pool, l.cfg.KVTTL, l.log); err != nil {
			return err
		}
	}
	cancelSub, err := l.nc.Subscribe(CancelSubject("*"), l.onCancel)
	if err != nil {
		return fmt.Errorf("subscribe to cancels: %w", err)
	}
	defer cancelSub.Unsubscribe()
	runningSub, err := l.nc.Subscribe(RunningSubject("*"), l.onRunning)
	if err != nil {
		return fmt.Errorf("subscribe to running queries: %w", err)
	}
	defer runningSub.Unsubscribe()
	if l.cfg.Stage == StageDecode && l.cfg.Release != nil {
		var releasing sync.WaitGroup
		defer releasing.Wait()
		sub, err := l.nc.QueueSubscribe(ReleaseNowSubject(l.cfg.Pool), "release", func(m *nats.Msg) {
			releasing.Go(func() { l.releaseNow(ctx, m) })
		})
		if err != nil {
			return fmt.Errorf("subscribe to direct releases: %w", err)
		}
		defer sub.Unsubscribe()
	}

	keep := newKeeper(l.js, l.cfg.Stage, l.cfg.KeepEvery, l.log)
	var bg sync.WaitGroup
	bg.Go(func() { keep.run(ctx) })
	bg.Go(func() { l.heartbeat(ctx) })
	bg.Go(func() { l.watchGateways(ctx) })
	bg.Go(func() { l.sampleDepth(ctx) })
	slots := make(chan struct{}, l.cfg.Slots)
	l.cfg.Metrics.pool(l.cfg.Stage, l.cfg.Pool)
	if l.cfg.Stage == StageDecode && l.cfg.Release != nil {
		bg.Go(func() { l.releaseLoop(ctx, slots) })
	}

	// Jobs outlive ctx by the grace period, so a shutdown does not abort
	// engine calls that are about to finish.
	jobCtx, stopJobs := context.WithCancel(context.WithoutCancel(ctx))
	defer stopJobs()
	var wg sync.WaitGroup
	pulls := newPuller(ctx, l.nc, l.js, l.cfg.PullWait) // stopped below, after the loop
	l.log.Info("stage worker pulling", "slots", l.cfg.Slots, "consumer", ConsumerName(l.cfg.Stage, l.cfg.Pool))
pull:
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			break pull
		}
		var permit Permit
		if l.cfg.Ready != nil {
			if permit, err = l.cfg.Ready(ctx); err != nil {
				break pull
			}
		}
		if gate != nil && gate.wait(ctx) != nil {
			permit.release()
			break pull
		}
		if l.cfg.EngineSlots != nil && l.cfg.EngineSlots.waitFree(ctx) != nil {
			permit.release()
			break pull
		}
		msg, err := pulls.next(ctx, cons)
		if err != nil {
			permit.release()
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
			if c, err := EnsureConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait, WithLogger(l.log)); err == nil {
				cons = c
			}
			continue
		}
		keep.tookJob()
		// The engine slot is taken at once, so that the next turn of the
		// loop sees it gone; losing a race for the last one, the job waits
		// for it in process.
		held := l.cfg.EngineSlots != nil && l.cfg.EngineSlots.TryAcquire()
		l.inFlight.Add(1)
		wg.Go(func() {
			defer func() {
				l.inFlight.Add(-1)
				<-slots
			}()
			l.process(ctx, jobCtx, msg, permit, held)
		})
	}

	// A job that came as the loop stopped goes back at once, for another
	// worker, rather than waiting out its ack wait here; within the grace.
	for _, msg := range pulls.stop() {
		wg.Go(func() { l.giveBack(context.WithoutCancel(ctx), msg) })
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
		l.log.Warn("grace period over: handing running jobs back", "in_flight", l.InFlight())
		stopJobs()
		<-done
	}
	bg.Wait()
	l.log.Info("stage worker stopped", "kv_released", l.Released(), "dead_letters_refused", l.dlqRefused.Load())
	return nil
}

// process runs one delivery: check it may run at all, run it, and settle
// it. pullCtx ends at shutdown, jobCtx at the end of the grace period.
// The permit Ready granted the pull is given back when the handler never
// gets the job (it was dropped, or stopped, before it ran).
func (l *StageLoop) process(pullCtx, jobCtx context.Context, msg jetstream.Msg, permit Permit, engineHeld bool) {
	handled := false
	defer func() {
		if !handled {
			permit.release()
		}
	}()
	// The engine slot, when held (from the pull, or taken below), is given
	// back once, however process ends.
	defer func() {
		if engineHeld {
			l.cfg.EngineSlots.Release()
		}
	}()
	attempt, stored := deliveryOf(msg) // stored: when the job's message was stored
	// Settling must finish even when the grace period is over; each NATS
	// call in it has the client's own default timeout.
	sctx := context.WithoutCancel(jobCtx)
	job, err := ParseJob(msg.Headers(), msg.Data())
	if err != nil {
		l.unreadable(sctx, msg, job, err)
		return
	}
	// The job stays in progress from its pull until it is settled: the
	// checks before it runs (a KV release) and storing a handoff or a dead
	// letter may take longer than the ack wait.
	stopProgress := l.keepAlive(jobCtx, msg)
	defer stopProgress()
	// It is registered before the checks, so that a cancel broadcast sent
	// while they run is not missed.
	jctx, cancel := context.WithCancelCause(jobCtx)
	defer cancel(nil)
	if !job.Deadline.IsZero() {
		// Every engine call of the job ends at the request's deadline,
		// whether or not a gateway is there to cancel it (a replay has
		// none, and a cancel may be lost).
		var stop context.CancelFunc
		jctx, stop = context.WithDeadlineCause(jctx, job.Deadline, errExpired)
		defer stop()
	}
	s := l.settleOf(msg, job, attempt)
	r := &runningJob{id: job.ID, gateway: job.GatewayID(), generation: job.Generation, origin: job.Origin, attempt: attempt,
		delivery: s.delivery, cancel: cancel}
	l.mu.Lock()
	l.running[r] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.running, r)
		l.mu.Unlock()
	}()

	// The engine slot is held before the checks, so that a handoff that
	// waited for it is judged by its age after the wait, and a KV release
	// on the way runs in it; it is given back as soon as the engine is
	// done, before settling.
	if e := l.cfg.EngineSlots; e != nil && !engineHeld {
		wctx, stop := context.WithCancel(jctx)
		unhook := context.AfterFunc(pullCtx, stop)
		err := e.acquire(wctx)
		unhook()
		stop()
		switch cause := context.Cause(jctx); {
		case err == nil:
			engineHeld = true
		case errors.Is(cause, errCancelled), errors.Is(cause, errGatewayGone), errors.Is(cause, errExpired):
			// Settled below, without a slot: it will not run.
		default:
			// The loop stops (a shutdown, or its model gone) before the
			// job ran.
			s.unrun(sctx, errors.New("the worker stopped before the job ran"))
			return
		}
	}
	s.engineHeld = engineHeld
	releaseEngine := func() {
		if engineHeld {
			engineHeld, s.engineHeld = false, false
			l.cfg.EngineSlots.Release()
		}
	}
	if !s.admit(sctx) {
		return
	}
	switch cause := context.Cause(jctx); {
	case errors.Is(cause, errCancelled), errors.Is(cause, errGatewayGone):
		s.stopped(sctx, cause)
		return
	case errors.Is(cause, errExpired):
		s.expired(sctx)
		return
	case cause != nil: // the grace period ended during the checks
		s.log.Warn("shutdown before the job ran; handing it back")
		s.unrun(sctx, errors.New("shutdown before the job ran")) // its KV unread, for the next delivery
		return
	}
	start := time.Now()
	s.run = &StageRecord{Stage: l.cfg.Stage, Generation: job.Generation, Worker: l.cfg.Worker.Worker,
		Engine: l.cfg.Worker.Engine, Started: start}
	d := &Delivery{Job: job, Attempt: attempt, loop: l, stopBeats: func() {}, permit: permit.Token, stop: cancel}
	d.ctx = jctx
	handled = true
	// A first delivery's wait is its queue time; a redelivery's, or a
	// handed-back copy's, would count an earlier attempt too.
	var waited time.Duration
	if attempt == 1 && job.HandBacks == 0 && !stored.IsZero() {
		waited = time.Since(stored)
	}
	l.cfg.Metrics.jobStarted(l.cfg.Stage, waited)
	err = l.handle(jctx, d)
	s.run.Ms = float64(time.Since(start).Microseconds()) / 1000
	releaseEngine()
	var took time.Duration
	if f := (*Failure)(nil); !d.Forwarded() && !(errors.As(err, &f) && f.HandBack) {
		took = time.Since(start) // it reached the engine
	}
	l.cfg.Metrics.jobEnded(l.cfg.Stage, took)
	d.stopBeats()
	// A job whose engine never ran it (a decode that waited for its
	// engine, say) counts as not run: a handoff's KV is unread, and is
	// released however the job ends.
	var unread *Failure
	s.ran = !errors.As(err, &unread) || !unread.Unread
	s.sent = d.sent()

	cause := context.Cause(jctx)
	expired := errors.Is(cause, errExpired)
	stoppedBy := errors.Is(cause, errCancelled) || errors.Is(cause, errGatewayGone)
	// A beat's answer stops a decode only if the handler ended by it: one
	// that came as the handler ended the reply itself (a beat racing its
	// end) leaves the handler's own outcome to settle.
	cutOff := errors.Is(err, context.Canceled)
	switch {
	case err == nil && d.handoff != nil && (stoppedBy || expired):
		// The prefill's answer came after its client had gone, or its
		// deadline (a prefill call waits a moment for an answer on its
		// way): its KV is released, not handed to a decode.
		s.queueRelease(sctx, d.handoff)
		if expired {
			s.expired(sctx)
		} else {
			s.stopped(sctx, cause)
		}
	case err == nil:
		l.recordDuration(time.Since(start))
		s.succeeded(sctx, d, time.Since(start))
	case stoppedBy:
		s.stopped(sctx, cause)
	case expired:
		s.expired(sctx)
	case cutOff && errors.Is(cause, errAbandoned):
		s.stopped(sctx, cause)
	case cutOff && errors.Is(cause, errSuperseded):
		// A later delivery of the job runs, and owns the request and the
		// message: nothing to record, ack or end here.
		s.log.Debug("job stopped: a later attempt of the request runs")
	case pullCtx.Err() != nil && jobCtx.Err() != nil:
		s.interrupted(sctx, err)
	default:
		s.failed(sctx, err)
	}
}

// handle runs the handler on a delivery. A handler that panics (a job that
// meets a bug) fails that job for good, kept for replay and answered, and
// the worker goes on: a panic would end the process, every stream it runs
// with it, and the job would come back to do the same to the next worker.
func (l *StageLoop) handle(ctx context.Context, d *Delivery) (err error) {
	defer func() {
		if v := recover(); v != nil {
			l.log.Error("the handler panicked: failing the job", logging.KeyRequestID, d.Job.ID,
				"panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			err = Permanent(fmt.Errorf("%s handler panicked: %v", l.cfg.Stage, v),
				openai.NewError(http.StatusInternalServerError, "pdq's %s worker failed on this request", l.cfg.Stage))
		}
	}()
	return l.cfg.Handler(ctx, d)
}

// giveBack returns a job that came as the loop stopped, not run.
func (l *StageLoop) giveBack(ctx context.Context, msg jetstream.Msg) {
	job, err := ParseJob(msg.Headers(), msg.Data())
	if err != nil {
		// Whoever runs it next settles it as unreadable.
		if nerr := msg.Nak(); nerr != nil {
			l.log.Warn("nak failed; the job will be redelivered after the ack wait", logging.Err(nerr))
		}
		return
	}
	attempt, _ := deliveryOf(msg)
	// Storing its copy may retry for a while: the job stays this loop's
	// meanwhile, not redelivered beside its copy.
	defer l.keepAlive(ctx, msg)()
	s := l.settleOf(msg, job, attempt)
	s.unrun(ctx, errors.New("the worker stopped as the job came"))
}

// deliveryOf is which delivery of its job msg is, and when the job was
// stored. A job stored again by a rebuild of its stream (see doctor.go)
// is a first delivery to NATS but may have run before: each of its
// deliveries counts one more than NATS says, so that it is judged as a
// redelivery (see replies for its replies).
func deliveryOf(msg jetstream.Msg) (attempt int, stored time.Time) {
	attempt = 1
	if meta, err := msg.Metadata(); err == nil {
		attempt, stored = int(meta.NumDelivered), meta.Timestamp
	}
	if msg.Headers().Get(HeaderRebuilt) != "" {
		attempt++
	}
	return attempt, stored
}

// rebuiltReplies numbers the replies of a job stored again by a rebuild
// above any delivery its first message can have had: the gateway takes
// them for a restart, not for more of an earlier delivery's answer.
const rebuiltReplies = 128

// unreadable settles a message that is not a job this build can run. It
// is kept in the dead-letter stream, recorded as failed, and its client
// answered when the reply subject could be read.
func (l *StageLoop) unreadable(ctx context.Context, msg jetstream.Msg, job *Job, err error) {
	l.log.Error("a job this worker cannot read", logging.Err(err), "subject", msg.Subject())
	id := job.ID
	if !ValidRequestID(id) {
		id = "invalid-" + randomID()
	}
	derr := l.deadLetter(ctx, msg, id, http.StatusInternalServerError, err.Error())
	if errors.Is(derr, errDLQFull) {
		l.log.Error("the dead-letter stream is full: this unreadable job is not kept", logging.Err(derr))
	} else if derr != nil {
		l.log.Error("could not keep an unreadable job in the dead-letter stream; it stays queued", logging.Err(derr))
		if nerr := msg.NakWithDelay(dlqRetry); nerr != nil {
			l.log.Warn("nak failed; the job comes back after the ack wait", logging.Err(nerr))
		}
		return
	}
	if ValidRequestID(job.ID) && job.Generation > 0 {
		if rerr := l.records.End(ctx, job.ID, job.Generation, StateFailed,
			&RecordError{Status: http.StatusInternalServerError, Message: err.Error(), Stage: l.cfg.Stage}); rerr != nil {
			l.log.Warn("could not record the failure", logging.Err(rerr))
		}
	}
	if job.ReplyTo != "" {
		e := openai.NewError(http.StatusInternalServerError, "pdq could not read the job: %v", err)
		if rerr := NewReplyWriter(l.nc, job.ReplyTo, ReplyAttempt(job.Generation, 255)).Error(e); rerr != nil {
			l.log.Warn("could not answer the client of an unreadable job", logging.Err(rerr))
		}
	}
	if terr := msg.TermWithReason(truncate(err.Error(), 256)); terr != nil {
		l.log.Warn("term failed; the job will come back and be dead-lettered again (deduplicated)", logging.Err(terr))
	}
}

// keepAlive tells JetStream the job is still running, every third of the
// ack wait, until stopped.
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
					l.log.Warn("in-progress signal failed; the job may be redelivered", logging.Err(err))
				}
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// onCancel stops the running jobs of a cancelled request: those of its
// origin (see Job.Origin). A cancel or a job without one (from a gateway
// of an older build) matches by id alone.
func (l *StageLoop) onCancel(msg *nats.Msg) {
	id := msg.Subject[len(CancelSubject("")):]
	origin, _ := strconv.Atoi(msg.Header.Get(HeaderOrigin))
	l.mu.Lock()
	defer l.mu.Unlock()
	for r := range l.running {
		if r.id == id && (origin == 0 || r.origin == 0 || r.origin == origin) {
			r.cancel(errCancelled)
		}
	}
}

// sampleDepth publishes how many jobs wait in this loop's queue, every
// heartbeat interval, until ctx ends. It runs on its own, with a short
// time-out, so that a slow JetStream delays no heartbeat.
func (l *StageLoop) sampleDepth(ctx context.Context) {
	if l.cfg.Metrics == nil {
		return
	}
	t := time.NewTicker(HeartbeatInterval)
	defer t.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		cons, err := l.js.Consumer(qctx, stageStream(l.cfg.Stage), ConsumerName(l.cfg.Stage, l.cfg.Pool))
		cancel()
		if err == nil { // else no consumer yet, or NATS away: the last value stands
			l.cfg.Metrics.depth(l.cfg.Stage, l.cfg.Pool, cons.CachedInfo().NumPending)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// onRunning answers whether this loop runs another delivery of the job a
// query names (its id, generation and the asker's delivery): a job
// redelivered while its first delivery still runs.
func (l *StageLoop) onRunning(msg *nats.Msg) {
	id := msg.Subject[len(RunningSubject("")):]
	gen, _ := strconv.Atoi(msg.Header.Get(HeaderGeneration))
	asker, _ := strconv.Atoi(msg.Header.Get(HeaderAttempt))
	delivery := msg.Header.Get(HeaderDelivery) // empty from a build before it
	stage := Stage(msg.Header.Get(HeaderStage))
	if stage != l.cfg.Stage {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for r := range l.running {
		other := r.attempt != asker
		if delivery != "" {
			other = r.delivery != delivery
		}
		if r.id == id && r.generation == gen && other {
			_ = msg.Respond(nil) // a lost answer only costs a duplicate run
			return
		}
	}
}

// runningElsewhere asks the stage loops whether another delivery of this
// job still runs. NATS redelivers a job whose worker could not signal
// progress for the ack wait, as when the worker was cut off from NATS
// while its engine call went on.
func (l *StageLoop) runningElsewhere(ctx context.Context, job *Job, attempt int, delivery string) bool {
	m := nats.NewMsg(RunningSubject(job.ID))
	m.Header[HeaderGeneration] = []string{strconv.Itoa(job.Generation)}
	m.Header[HeaderAttempt] = []string{strconv.Itoa(attempt)}
	m.Header[HeaderDelivery] = []string{delivery}
	m.Header[HeaderStage] = []string{string(l.cfg.Stage)}
	wait := runningQueryWait
	if l.reconnectedWithin(10 * time.Second) {
		wait = runningQueryWaitReconnected
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	_, err := l.nc.RequestMsgWithContext(ctx, m)
	return err == nil
}

// The waits for an answer to a running query. A loop that runs the job
// answers within a round trip; only loops that run it answer, so every
// query nobody answers costs the whole wait. Just after a NATS restart,
// processes reconnect up to a few hundred milliseconds apart (they retry
// every 250 ms), so a loop that reconnected lately waits longer.
const (
	runningQueryWait            = 100 * time.Millisecond
	runningQueryWaitReconnected = time.Second
)

// reconnectedWithin reports whether this loop's connection came back from
// an outage within d, as far as its queries have seen.
func (l *StageLoop) reconnectedWithin(d time.Duration) bool {
	n := l.nc.Stats().Reconnects
	l.mu.Lock()
	defer l.mu.Unlock()
	if n != l.reconnects {
		l.reconnects, l.reconnectedAt = n, time.Now()
	}
	return !l.reconnectedAt.IsZero() && time.Since(l.reconnectedAt) < d
}

// watchGateways stops the running jobs whose gateway is gone: nobody would
// read their output.
func (l *StageLoop) watchGateways(ctx context.Context) {
	t := time.NewTicker(HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		l.mu.Lock()
		byGateway := make(map[string][]context.CancelCauseFunc)
		for r := range l.running {
			if r.gateway != "" {
				byGateway[r.gateway] = append(byGateway[r.gateway], r.cancel)
			}
		}
		l.mu.Unlock()
		for gw, cancels := range byGateway {
			if l.liveness.Alive(ctx, gw) {
				continue
			}
			l.log.Warn("gateway gone: stopping its running jobs", "gateway_id", gw, "jobs", len(cancels))
			for _, c := range cancels {
				c(errGatewayGone)
			}
		}
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
