package workers

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/enginecall"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/nixl"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// maxResponseBytes bounds a non-streamed engine response held in memory:
// the largest whole answer a gateway's reply queue is sized for.
const maxResponseBytes = reply.MaxWholeAnswer

// Config configures one worker: one engine, one role.
type Config struct {
	Role      dispatcher.Stage
	EngineURL string
	// EngineAPIKey is the engine's --api-key (PDQ_ENGINE_API_KEY), sent
	// on every call; empty sends none.
	EngineAPIKey string
	// Slots is the engine's concurrency for this worker
	// (config.EngineSlotsFor); required, as are Grace to BreakerFailures
	// and ModelsRefresh: config gives each, and New fills in none.
	Slots int
	// KVHost is the routable host to advertise as remote_host when a
	// prefill engine reports a loopback or unspecified one; empty falls
	// back to the engine URL's host when that is routable.
	KVHost string
	// Grace is how long running jobs may finish at shutdown.
	Grace time.Duration
	// RetryBase is the delay before a failed job's first retry
	// (config.RetryBase).
	RetryBase time.Duration
	// KVTTL is the oldest handoff a decode worker runs (PDQ_KV_TTL).
	KVTTL time.Duration
	// MaxGenerations bounds the prefills of one request
	// (PDQ_MAX_GENERATIONS).
	MaxGenerations int
	// AckWait is the consumer's ack wait (PDQ_ACK_WAIT).
	AckWait time.Duration
	// MaxDeliver bounds the deliveries of one job (PDQ_MAX_DELIVER).
	MaxDeliver int
	// PrefillTimeout bounds a prefill engine's answer (PDQ_PREFILL_TIMEOUT).
	PrefillTimeout time.Duration
	// StallTimeout bounds a decode engine's silence before its first chunk
	// and between chunks (PDQ_STALL_TIMEOUT).
	StallTimeout time.Duration
	// BreakerFailures is how many consecutive engine failures open the
	// worker's breaker (PDQ_BREAKER_FAILURES).
	BreakerFailures int
	// PrefillFallback is "decode" (the default) or "fail": whether a prefill
	// worker whose engine is down forwards its jobs decode-only while no
	// other prefill worker of its pool is healthy.
	PrefillFallback string
	// Affinity takes the jobs that prefer this worker's engine from its
	// own queue, beside the pool's (PDQ_AFFINITY).
	Affinity bool
	// MigrationLimit bounds how many times a decode that fails after
	// output moves to another engine (PDQ_MIGRATION_LIMIT); 0 ends such a
	// stream with an error.
	MigrationLimit int
	// Replicas is the replica count of the registry bucket, should the
	// worker find it missing and create it (PDQ_NATS_REPLICAS); 0 is 1.
	Replicas int
	// ModelsRefresh is how often the worker re-reads the engine's
	// /v1/models (config.ModelsRefresh).
	ModelsRefresh time.Duration
	// Metrics are the stage loops' series, EngineMetrics the engine's
	// (its breaker and slots); nil counts nothing.
	Metrics       *stage.Metrics
	EngineMetrics *Metrics
	// LocalReplies are the gateways in this process (pdq up), which take
	// replies without NATS; nil sends them all over NATS.
	LocalReplies *reply.LocalReplies
}

// Worker runs one stage on one engine.
//
// Run is called once. Its goroutine serves the models (serveModels); each
// model's stage loop runs in a goroutine of its own, with the goroutines
// it starts (see [stage.Loop]), and so do followLoad, the
// breaker's probes and, on a decode worker, the engine calls. The
// handler (observed, prefill, decode) runs on the job goroutines, any
// number at once; alone on those and on the loops' pull goroutines.
type Worker struct {
	// Set by New, read without a lock.
	cfg    Config
	nc     *nats.Conn
	js     jetstream.JetStream
	log    *slog.Logger
	engine *vllm.Client
	kvHost string
	id     string // the registry key, and StageRecord.Worker
	// breaker stops the pulls while the engine keeps failing. It has its
	// own lock.
	breaker *breaker
	// peers are the live workers, to know whether another worker of the
	// stage has a healthy engine. Set by Run before the first stage loop
	// starts, read without a lock (nil before).
	peers *registry.Registry
	// slots bounds the engine calls of all the worker's models together.
	// It has its own lock.
	slots *pull.EngineSlots

	// mu guards the served models and the last answers of alone, kept to
	// log their changes.
	mu     sync.Mutex
	served []vllm.Model
	lonely map[string]bool

	// clock predicts the prefill engine's ends (prefill workers). It has
	// its own lock.
	clock prefillClock

	// refusals counts the prefill engine's 4xx answers, sent decode-only:
	// an atomic, added to by the job goroutines without mu.
	refusals atomic.Int64
}

// New checks cfg and builds a worker; Run starts it.
func New(nc *nats.Conn, js jetstream.JetStream, cfg Config, log *slog.Logger) (*Worker, error) {
	if cfg.Role != dispatcher.StagePrefill && cfg.Role != dispatcher.StageDecode {
		return nil, fmt.Errorf("worker: unknown role %q", cfg.Role)
	}
	for _, d := range []struct {
		name string
		ok   bool
	}{
		{"slots", cfg.Slots > 0}, {"grace", cfg.Grace > 0}, {"retry base", cfg.RetryBase > 0},
		{"ack wait", cfg.AckWait > 0}, {"KV TTL", cfg.KVTTL > 0}, {"max generations", cfg.MaxGenerations > 0},
		{"max deliveries", cfg.MaxDeliver > 0}, {"prefill time-out", cfg.PrefillTimeout > 0},
		{"stall time-out", cfg.StallTimeout > 0}, {"breaker failures", cfg.BreakerFailures > 0},
		{"models refresh", cfg.ModelsRefresh > 0},
	} {
		if !d.ok {
			return nil, fmt.Errorf("worker: the %s must be positive (config gives every setting)", d.name)
		}
	}
	engine, err := vllm.New(cfg.EngineURL, cfg.Slots, cfg.EngineAPIKey)
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	w := &Worker{cfg: cfg, nc: nc, js: js, engine: engine, slots: pull.NewEngineSlots(cfg.Slots),
		lonely: make(map[string]bool),
		log:    log.With(logging.KeyComponent, string(cfg.Role), "engine", engine.URL())}
	w.id = dispatcher.NewWorkerID(cfg.Role)
	w.breaker = newBreaker(cfg.BreakerFailures, engine, cfg.Role, cfg.EngineMetrics, w.log)
	w.kvHost = cfg.KVHost
	if w.kvHost == "" && !nixl.IsLocalHost(engine.Host()) {
		w.kvHost = engine.Host()
	}
	return w, nil
}

// Run learns the engine's models, then pulls the jobs of each model's pool
// until ctx ends. It re-reads the engine's models every ModelsRefresh, so
// that an adapter loaded at run time joins its pool, and one unloaded
// leaves it. A worker stopped while it still waits for its engine stops
// cleanly: it had taken no job.
func (w *Worker) Run(ctx context.Context) error {
	models, err := w.discover(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	// The engine's slots follow its load while the worker runs; the first
	// look is made before the first pull.
	looked, followed := make(chan struct{}), make(chan struct{})
	loadCtx, stopLoad := context.WithCancel(ctx)
	go func() {
		defer close(followed)
		w.followLoad(loadCtx, looked)
	}()
	defer func() {
		stopLoad()
		<-followed
	}()
	<-looked
	if ctx.Err() != nil {
		return nil // stopped during the first look: no job taken
	}
	w.breaker.life = ctx
	w.breaker.generate = func(ctx context.Context) error {
		return w.engine.Generate(ctx, w.probeModel(), "pdq-probe-"+w.id)
	}
	if w.peers, err = registry.WatchWorkers(ctx, w.js, w.log); err != nil {
		return err
	}
	if w.cfg.Role != dispatcher.StageDecode {
		return w.serveModels(ctx, models)
	}
	calls, err := enginecall.Serve(w.nc, w.id, engineCallLimit, w.engineCall)
	if err != nil {
		return fmt.Errorf("decode worker: take engine calls: %w", err)
	}
	// At shutdown, alongside the stage loops: no new calls, and the running
	// ones get the same grace as the jobs.
	ctx, cancel := context.WithCancel(ctx)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		calls.Stop(w.cfg.Grace)
	}()
	err = w.serveModels(ctx, models)
	cancel()
	<-stopped
	return err
}

// loopConfig is the stage loop of one model the engine serves.
func (w *Worker) loopConfig(m vllm.Model, entry string) stage.Config {
	handler, release := w.decode, w.release
	if w.cfg.Role == dispatcher.StagePrefill {
		handler, release = w.prefill, nil
	}
	alone := func() bool { return w.alone(m.ID) }
	return stage.Config{
		Stage:          w.cfg.Role,
		Pool:           dispatcher.PoolName(m.ID),
		Slots:          w.cfg.Slots,
		EngineSlots:    w.slots,
		Affinity:       w.cfg.Affinity,
		Handler:        w.observed(handler),
		Ready:          func(ctx context.Context) (stage.Permit, error) { return w.breaker.wait(ctx, alone) },
		Health:         w.breaker.Health,
		Release:        release,
		Grace:          w.cfg.Grace,
		RetryBase:      w.cfg.RetryBase,
		PullWait:       config.PullWait,
		KeepEvery:      config.KeepEvery,
		AckWait:        w.cfg.AckWait,
		KVTTL:          w.cfg.KVTTL,
		MaxGenerations: w.cfg.MaxGenerations,
		MaxDeliver:     w.cfg.MaxDeliver,
		StallTimeout:   w.cfg.StallTimeout,
		Replicas:       w.cfg.Replicas,
		Metrics:        w.cfg.Metrics,
		LocalReplies:   w.cfg.LocalReplies,
		Registry:       w.peers,
		Worker: dispatcher.WorkerInfo{
			ID: entry, Worker: w.id, Model: m.ID, Engine: w.engine.URL(), Started: time.Now(),
			Affinity:    w.cfg.Affinity,
			MaxModelLen: m.MaxModelLen, Card: m.Card,
		},
	}
}

// discover asks the engine which models it serves, retrying with back-off
// while the engine starts.
func (w *Worker) discover(ctx context.Context) ([]vllm.Model, error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
	var models []vllm.Model
	err := backoff.RetryNotify(func() error {
		var err error
		models, err = w.engine.Models(ctx)
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		w.log.Warn("engine not ready; retrying", logging.Err(err), "retry_in", next.Round(time.Millisecond).String())
	})
	if err != nil {
		return nil, fmt.Errorf("%s worker: discover the engine's models: %w", w.cfg.Role, err)
	}
	return models, nil
}
