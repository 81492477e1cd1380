package stage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/dispatcher/queues"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/reply"
)

// retryDelay is the NakWithDelay back-off, capped at 10s. A plain Nak would
// redeliver at once and storm an engine that is down.
func retryDelay(base time.Duration, attempt int) time.Duration {
	d := base
	for i := 1; i < attempt; i++ {
		d *= 4
	}
	return min(d, 10*time.Second)
}

// Limits of the stage loop.
const (
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

// Config configures a [Loop].
type Config struct {
	Stage dispatcher.Stage
	Pool  string
	// Slots is how many jobs run at once: the engine's concurrency. A job
	// is pulled only when a slot is free.
	Slots int
	// EngineSlots, when set, are the engine's slots, shared with the loops
	// of the engine's other models (see [EngineSlots]).
	EngineSlots *pull.EngineSlots
	Handler     Handler
	// Release frees the prefill engine's KV blocks of a handoff that will
	// not be decoded (cancelled, expired, superseded, too old, rejected by
	// the engine). Decode stages set it; it is never called for a handoff
	// a decode engine may already have read.
	Release func(ctx context.Context, job *dispatcher.Job) error
	// Worker describes the worker in the registry; its Role, Pool and Slots
	// are filled in from this config.
	Worker dispatcher.WorkerInfo
	// Grace to StallTimeout are required: config gives each (config.Load
	// and config's constants), and the loop fills in none.
	//
	// Grace is how long in-flight jobs may run on after Run's context ends;
	// the rest are handed back for redelivery.
	Grace time.Duration
	// RetryBase is the delay before the first retry of a failed job; each
	// next one is 4 times longer.
	RetryBase time.Duration
	// Affinity takes the jobs that prefer its engine
	// (dispatcher.Job.Preferred) from the engine's own consumer beside the
	// pool's, and takes over those that wait for other engines which
	// cannot take them (see takeOver).
	Affinity bool
	// PullWait is how long a pull waits on the server for a job; under
	// 10 ms is refused. A loop that stops waits for its pull to end (this
	// long at most while its server answers, pullSilence more when it does
	// not), so that a job the server sends as it stops reaches it, to be
	// given back, rather than being dropped.
	PullWait time.Duration
	// AckWait is the consumer's ack wait. All workers of a pool should
	// agree on it.
	AckWait time.Duration
	// KeepEvery is how often a loop that takes jobs renews its stream's
	// keeper (see dispatcher/pull/keeper.go).
	KeepEvery time.Duration
	// KVTTL is the oldest handoff a decode stage runs.
	KVTTL time.Duration
	// MaxGenerations bounds the prefills of one request.
	MaxGenerations int
	// MaxDeliver bounds the deliveries of one job.
	MaxDeliver int
	// StallTimeout is how long the gateway waits for a sign of a running
	// decode. A decode delivery beats well within it, and waits at most
	// this long (10 s at most) for the gateway to acknowledge the end of a
	// reply.
	StallTimeout time.Duration
	// Ready, when set, is called before each pull and returns when the
	// worker may take a job (its engine's breaker lets it). The handler
	// reads the permit's token back (Delivery.Permit); the loop releases
	// the permit when the pull got no job or the job never reached the
	// handler.
	Ready func(ctx context.Context) (Permit, error)
	// Health, when set, is the worker's breaker state for the registry, and
	// a channel closed at its next change, when the worker beats at once.
	Health func() (dispatcher.BreakerState, <-chan struct{})
	// Replicas is the replica count of the pdq_workers bucket, should
	// this loop find it missing and create it (PDQ_NATS_REPLICAS); 0 is 1.
	Replicas int
	// Metrics counts dead letters and KV releases; nil counts nothing.
	Metrics *Metrics
	// LocalReplies are the gateways in this process, which take replies
	// without NATS; nil sends every reply over NATS.
	LocalReplies *reply.LocalReplies
	// Registry, when set, is the worker's view of the live workers, which
	// a prefill loop's decode gate reads; nil makes the loop its own.
	// Each registry hears every worker's heartbeats: one a process, not
	// one a loop.
	Registry *registry.Registry
}

// Permit is what Config.Ready grants a pull.
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

// Loop pulls jobs of one stage and pool and runs them.
//
// Run is called once; its goroutine pulls. Each job runs in a goroutine
// of its own (process, which calls the handler), and so do its keepAlive
// and its reply's beats, the keeper, heartbeat, watchGateways and
// sampleDepth, a decode stage's releaseLoop, and each direct release
// (releaseNow). onCancel and onRunning run on their subscriptions'
// goroutines. InFlight and Released may be called from any goroutine.
type Loop struct {
	// Set by NewLoop; cfg.AckWait, records, kvReads and decodeGate are
	// set by Run before it subscribes or starts a goroutine. Read without
	// a lock.
	cfg     Config
	nc      *nats.Conn
	js      jetstream.JetStream
	records *dispatcher.Records
	// kvReads claims handoffs' KV for one reader (decode stage only).
	kvReads *dispatcher.KVReads
	// decodeGate is a prefill loop's (nil for decode).
	decodeGate *pull.DecodeGate
	queues     *queues.Watch // the pool's queues of this stage, once Run started
	liveness   *registry.Liveness
	log        *slog.Logger

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
	// answered are decodes of this loop that beat and ended their job
	// (its answer sent, or its end lost on the way), kept a while for the
	// running query (see keepAnswered).
	answered []answeredDecode
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
	// admitted is set once the delivery passed its checks and runs: from
	// then on it answers a redelivery's running query (onRunning); before,
	// only a later delivery's, so that of two copies at their checks one
	// gives way, not both.
	admitted bool
	cancel   context.CancelCauseFunc
	// beating is when the delivery's handler began to beat to its
	// gateway (Delivery.Replies); zero before, and again once it
	// returned: the gateway's running query (dispatcher.DecodeBeating)
	// asks whether a decode it heard from still runs.
	beating time.Time
}

// answeredDecode is a decode that beat from began and ended its job, kept
// until until.
type answeredDecode struct {
	id           string
	generation   int
	began, until time.Time
}

// keepAnswered keeps, for twice the stall time-out, that r beat from
// began and ended its job: a gateway whose stall timer fires after it
// ended, having heard its first beat and nothing since (its chunks and
// end lost), is told that the decode beat (dispatcher.DecodeBeating), and
// fails the request as a silent decode's, rather than waiting for a
// redelivery that will not come (the job was acked) until its deadline.
// A decode that gave its job back (handed back, retried) is not kept:
// the job waits for its next decode.
func (l *Loop) keepAnswered(r *runningJob, began time.Time) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	// Kept in the order they end, each as long: the expired are in front.
	i := 0
	for i < len(l.answered) && now.After(l.answered[i].until) {
		i++
	}
	l.answered = append(l.answered[i:], answeredDecode{id: r.id, generation: r.generation, began: began, until: now.Add(2 * l.cfg.StallTimeout)})
}

// setBeating marks r beating since t, or not beating (zero t).
func (l *Loop) setBeating(r *runningJob, t time.Time) {
	if r == nil {
		return
	}
	l.mu.Lock()
	r.beating = t
	l.mu.Unlock()
}

// Causes of a job stopped while it runs.
var (
	errCancelled   = errors.New("cancelled by the client")
	errGatewayGone = errors.New("the gateway holding the client is gone")
	errExpired     = errors.New("the request's deadline passed")
)

// wanted says whether job's request still wants its work, by its record:
// not once the request has ended, moved on to a later generation, or been
// taken over. A record that cannot be read is no reason to stop.
func (l *Loop) wanted(job *dispatcher.Job) func(context.Context) bool {
	return func(ctx context.Context) bool {
		rec, _, err := l.records.Get(ctx, job.ID)
		if err != nil {
			return true
		}
		return !rec.State.Ended() && rec.Generation <= job.Generation && rec.Gateway == job.GatewayID()
	}
}

// NewLoop builds a loop; Run starts it.
func NewLoop(nc *nats.Conn, js jetstream.JetStream, cfg Config, log *slog.Logger) (*Loop, error) {
	if cfg.Stage != dispatcher.StagePrefill && cfg.Stage != dispatcher.StageDecode {
		return nil, fmt.Errorf("stage loop: unknown stage %q", cfg.Stage)
	}
	if cfg.Pool == "" || cfg.Slots < 1 || cfg.Handler == nil {
		return nil, fmt.Errorf("stage loop: pool, slots >= 1 and a handler are required")
	}
	for _, d := range []struct {
		name string
		ok   bool
	}{
		{"grace", cfg.Grace > 0}, {"retry base", cfg.RetryBase > 0}, {"ack wait", cfg.AckWait > 0},
		{"keep interval", cfg.KeepEvery > 0}, {"KV TTL", cfg.KVTTL > 0}, {"max generations", cfg.MaxGenerations > 0},
		{"max deliveries", cfg.MaxDeliver > 0}, {"stall time-out", cfg.StallTimeout > 0},
	} {
		if !d.ok {
			return nil, fmt.Errorf("stage loop: the %s must be positive (config gives every setting)", d.name)
		}
	}
	if cfg.PullWait < pull.MinPullWait {
		return nil, fmt.Errorf("stage loop: a pull wait under %s would pull without a pause", pull.MinPullWait)
	}
	cfg.Worker.Role, cfg.Worker.Pool, cfg.Worker.Slots = cfg.Stage, cfg.Pool, cfg.Slots
	return &Loop{
		cfg: cfg, nc: nc, js: js, liveness: registry.NewLiveness(nc),
		log:     log.With("stage", string(cfg.Stage), "pool", cfg.Pool),
		running: make(map[*runningJob]struct{}),
	}, nil
}

// InFlight is the number of jobs running now.
func (l *Loop) InFlight() int { return int(l.inFlight.Load()) }

// recordDuration folds a finished job's duration into the average.
func (l *Loop) recordDuration(d time.Duration) { l.durations.add(d) }

func (l *Loop) avgJobMs() float64 { return l.durations.avgMs() }

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
func (l *Loop) Released() int64 { return l.released.Load() }

// Run pulls and runs jobs until ctx ends, then lets running jobs finish
// within the grace period and hands the rest back.
func (l *Loop) Run(ctx context.Context) error {
	// Its consumer and buckets, waited for while JetStream does not answer
	// (the pool's other workers may be creating the consumer); a refusal
	// ends the loop.
	var cons jetstream.Consumer
	err := dispatcher.UntilAnswered(ctx, l.log, "the stage loop's consumer and buckets", func(ctx context.Context) error {
		var err error
		if cons, err = dispatcher.EnsureConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait, dispatcher.WithLogger(l.log)); err != nil {
			return err
		}
		if l.records, err = dispatcher.OpenRecords(ctx, l.js); err != nil {
			return err
		}
		if l.cfg.Stage == dispatcher.StageDecode {
			l.kvReads, err = dispatcher.OpenKVReads(ctx, l.js)
		}
		return err
	})
	if err != nil {
		return err
	}
	// The consumer's stored ack wait is the one in force (its first
	// creator's): running jobs signal progress by it.
	if aw := cons.CachedInfo().Config.AckWait; aw > 0 {
		l.cfg.AckWait = aw
	}
	// This loop's pool's queues, and on prefill the decode pool's, for
	// the take-over, the queue-depth metric and the decode gate: one
	// worker of the pool lists them for all (dispatcher/queues). The
	// watches end with Run, however it ends: a loop that failed must not
	// go on reporting for its pool.
	wctx, stopWatches := context.WithCancel(ctx)
	defer stopWatches()
	opts := queues.Options{ID: l.cfg.Worker.ID, Publish: true, Log: l.log}
	if l.affinity() {
		opts.Adopt = func(ctx context.Context) {
			pull.AdoptOrphans(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait, l.log)
		}
	}
	if l.queues, err = queues.Open(wctx, l.js, l.cfg.Stage, l.cfg.Pool, opts); err != nil {
		return fmt.Errorf("watch the pool's queues: %w", err)
	}
	var gate *pull.DecodeGate
	if l.cfg.Stage == dispatcher.StagePrefill {
		decode, err := queues.Open(wctx, l.js, dispatcher.StageDecode, l.cfg.Pool, queues.Options{Log: l.log})
		if err != nil {
			return fmt.Errorf("watch the pool's decode queues: %w", err)
		}
		reg := l.cfg.Registry
		if reg == nil {
			if reg, err = registry.WatchWorkers(wctx, l.js, l.log); err != nil {
				return err
			}
		}
		gate = pull.NewDecodeGate(decode, reg, l.cfg.Pool, l.cfg.KVTTL, l.log)
		l.decodeGate = gate
	}
	cancelSub, err := l.nc.Subscribe(dispatcher.CancelSubject("*"), l.onCancel)
	if err != nil {
		return fmt.Errorf("subscribe to cancels: %w", err)
	}
	defer cancelSub.Unsubscribe()
	runningSub, err := l.nc.Subscribe(dispatcher.RunningSubject("*"), l.onRunning)
	if err != nil {
		return fmt.Errorf("subscribe to running queries: %w", err)
	}
	defer runningSub.Unsubscribe()
	if l.cfg.Stage == dispatcher.StageDecode && l.cfg.Release != nil {
		var releasing sync.WaitGroup
		defer releasing.Wait()
		sub, err := l.nc.QueueSubscribe(dispatcher.ReleaseNowSubject(l.cfg.Pool), "release", func(m *nats.Msg) {
			releasing.Go(func() { l.releaseNow(ctx, m) })
		})
		if err != nil {
			return fmt.Errorf("subscribe to direct releases: %w", err)
		}
		defer sub.Unsubscribe()
	}

	var own *pullSource
	if l.affinity() {
		if own, err = l.ownSource(ctx); err != nil {
			return err
		}
	}

	keep := pull.NewKeeper(l.js, l.cfg.Stage, l.cfg.KeepEvery, l.log)
	var bg sync.WaitGroup
	bg.Go(func() { keep.Run(ctx) })
	bg.Go(func() { l.heartbeat(ctx) })
	bg.Go(func() { l.watchGateways(ctx) })
	bg.Go(func() { l.sampleDepth(ctx) })
	// With affinity, the engine's own consumer is pulled beside the
	// pool's: each needs a pull waiting whenever the engine has room, so
	// the own one has a slot of its own. Two jobs that come at once for
	// the engine's last seat: the second waits for it in process (see
	// EngineSlots).
	extra := 0
	if own != nil {
		extra = 1
	}
	slots := make(chan struct{}, l.cfg.Slots+extra)
	l.cfg.Metrics.pool(l.cfg.Stage, l.cfg.Pool)
	if l.cfg.Stage == dispatcher.StageDecode && l.cfg.Release != nil {
		bg.Go(func() { l.releaseLoop(ctx, slots) })
	}

	// Jobs outlive ctx by the grace period, so a shutdown does not abort
	// engine calls that are about to finish.
	jobCtx, stopJobs := context.WithCancel(context.WithoutCancel(ctx))
	defer stopJobs()
	var wg sync.WaitGroup
	l.log.Info("stage worker pulling", "slots", l.cfg.Slots, "consumer", dispatcher.ConsumerName(l.cfg.Stage, l.cfg.Pool),
		"affinity", l.affinity())
	src := &pullSource{from: pulledShared, pulls: pull.NewPuller(ctx, l.nc, l.js, l.cfg.PullWait), cons: cons, ensure: func(ctx context.Context) (jetstream.Consumer, error) {
		return dispatcher.EnsureConsumer(ctx, l.js, l.cfg.Stage, l.cfg.Pool, l.cfg.AckWait, dispatcher.WithLogger(l.log))
	}}
	sources := []*pullSource{src}
	var pullers sync.WaitGroup
	if own != nil {
		// The jobs that prefer this engine, pulled beside the pool's; and
		// those waiting for other engines that cannot take them.
		sources = append(sources, own)
		pullers.Go(func() { l.pullLoop(ctx, jobCtx, own, slots, gate, keep, &wg) })
		pullers.Go(func() { l.takeOver(ctx, jobCtx, slots, gate, keep, &wg) })
	}
	l.pullLoop(ctx, jobCtx, src, slots, gate, keep, &wg)
	pullers.Wait()

	// A job that came as the loop stopped goes back at once, for another
	// worker, rather than waiting out its ack wait here; within the grace.
	for _, s := range sources {
		for _, msg := range s.pulls.Stop() {
			wg.Go(func() { l.giveBack(context.WithoutCancel(ctx), msg) })
		}
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
