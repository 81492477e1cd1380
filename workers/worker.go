package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
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
	"github.com/pdq-dev/pdq/pkg/openai"
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
	// Metrics counts dead letters and KV releases; nil counts nothing.
	Metrics *dispatcher.Metrics
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
	w.breaker = newBreaker(cfg.BreakerFailures, engine, cfg.Role, cfg.Metrics, w.log)
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
		Worker: dispatcher.WorkerInfo{
			ID: entry, Worker: w.id, Model: m.ID, Engine: w.engine.URL(), Started: time.Now(),
			MaxModelLen: m.MaxModelLen, Card: m.Card,
		},
	}
}

// observed runs a handler and tells the breaker how the engine did. A
// prefill worker whose breaker is open forwards jobs decode-only while no
// other prefill worker of its pool is healthy, instead of failing them.
func (w *Worker) observed(h stage.Handler) stage.Handler {
	return func(ctx context.Context, d *stage.Delivery) error {
		tok := d.Permit()
		if !w.breaker.admits(tok) {
			switch {
			case !w.alone(d.Job.Model):
				// A pull on its way when the breaker opened (or a pull
				// other than a half-open breaker's trial): another worker's
				// engine is healthy, so the job goes back without touching
				// this one.
				return stage.HandBack(errHandedBack,
					openai.NewError(http.StatusServiceUnavailable, "%s engine unavailable", w.cfg.Role))
			case w.canForward():
				w.forward(d)
				return nil
			}
		}
		if w.avoids(d.Job) {
			w.breaker.neutral(tok)
			return stage.HandBack(errAvoided,
				openai.NewError(http.StatusServiceUnavailable, "%s engine unavailable", w.cfg.Role))
		}
		err := h(ctx, d)
		var fault *engineFault
		switch {
		case err == nil && d.Moved() && errors.As(d.MovedFrom(), &fault):
			// The engine failed mid-stream (not, say, NATS refusing a
			// chunk): the handler moved the rest elsewhere.
			w.breaker.failed(ctx, tok, fault.unreachable, d.MovedFrom())
		case err == nil && d.Moved():
			w.breaker.neutral(tok)
		case err == nil:
			w.breaker.succeeded(tok)
		case errors.As(err, &fault) && ctx.Err() == nil:
			w.breaker.failed(ctx, tok, fault.unreachable, err)
		default:
			w.breaker.neutral(tok)
		}
		var f *stage.Failure
		if err != nil && ctx.Err() == nil && errors.As(err, &f) && !f.Permanent && w.breaker.Open() && w.alone(d.Job.Model) && w.canForward() {
			w.forward(d)
			return nil
		}
		return err
	}
}

// alone reports whether no other worker of this stage serves the model
// with a healthy engine. A worker whose breaker is open stops pulling only
// when another can take the work: alone, it keeps pulling, and a prefill
// worker forwards its jobs decode-only (PDQ_PREFILL_FALLBACK=decode) while
// any other job runs on the sick engine and fails on its own, through the
// retries to its client, instead of waiting for its deadline in the queue.
// Each change is logged once.
func (w *Worker) alone(model string) bool {
	if w.peers == nil {
		return false
	}
	ok := !w.healthyPeer(model, "")
	w.mu.Lock()
	was, seen := w.lonely[model]
	w.lonely[model] = ok
	w.mu.Unlock()
	if (!seen || was != ok) && w.breaker.Open() {
		if ok {
			w.log.Warn("engine failing and no other healthy "+string(w.cfg.Role)+" worker: pulling on", "model", model, "forward_decode_only", w.canForward())
		} else {
			w.log.Info("another "+string(w.cfg.Role)+" worker is healthy: this one waits for its engine", "model", model)
		}
	}
	return ok
}

// A continuation is handed on from the engine it broke on at most
// avoidHandBacks times, and for avoidFor after the break: past either it
// runs there rather than wait longer. Each hand-back queues it anew,
// behind any backlog, and a healthy worker whose slots are all busy has
// no pull to take it.
const (
	avoidHandBacks = 6
	avoidFor       = 5 * time.Second
)

// avoids reports whether job is the continuation of a decode that broke
// on this worker's engine, while another worker of its model has a
// healthy engine. Here it would likely break again, past the migration
// limit, and end in an error: Dynamo keeps such a worker out of a
// migration's choice for a while; pdq's workers pull, so this one hands
// the continuation on. The hand-back goes to the oldest waiting pull,
// which is rarely this worker's own: it pulled again as the job came.
func (w *Worker) avoids(job *dispatcher.Job) bool {
	r := job.Resume
	return r != nil && r.Avoid == w.engine.URL() && time.Now().UnixMilli() < r.AvoidUntil &&
		job.HandBacks < avoidHandBacks && w.healthyPeer(job.Model, w.engine.URL())
}

// healthyPeer reports whether another worker of this stage serves model
// with a healthy engine other than engine ("": any).
func (w *Worker) healthyPeer(model, engine string) bool {
	if w.peers == nil {
		return false
	}
	for _, p := range w.peers.Workers() {
		if p.Role == w.cfg.Role && p.WorkerID() != w.id && p.Model == model && p.Healthy() && (engine == "" || p.Engine != engine) {
			return true
		}
	}
	return false
}

// errAvoided is the failure of a continuation handed on from the engine
// it broke on.
var errAvoided = errors.New("the decode broke on this engine: continuation handed on to another")

// errHandedBack is the failure of a job pulled as the worker's breaker
// opened: it never reached the engine.
var errHandedBack = errors.New("engine failing (breaker open): job handed back to the queue")

// canForward reports whether this worker sends its jobs on decode-only
// when its engine is down and it is alone: a prefill worker with the
// fallback on.
func (w *Worker) canForward() bool {
	return w.cfg.Role == dispatcher.StagePrefill && w.cfg.PrefillFallback != config.FallbackFail
}

// forward sends a job on to decode-only.
func (w *Worker) forward(d *stage.Delivery) {
	d.Forward()
	w.cfg.Metrics.Fallback(d.Job.Pool, "prefill")
	w.cfg.Metrics.DecodeOnly("no_healthy_prefill")
	w.log.Debug("prefill engine down: forwarded decode-only", logging.KeyRequestID, d.Job.ID)
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

// call sends one leg of a job to the engine. Both legs go through here, so
// both carry the job's id as X-Request-Id. It returns the response of a 200;
// any other answer, or none, comes back classified for the ack policy.
func (w *Worker) call(ctx context.Context, job *dispatcher.Job, body ...[]byte) (*http.Response, error) {
	resp, err := w.engine.Post(ctx, job.Endpoint, job.ID, body...)
	if err != nil {
		var op *net.OpError
		if errors.As(err, &op) && op.Op == "dial" {
			// No connection, so no request: the engine never saw it.
			err = &notRun{err: err}
		}
		return nil, unreachable(ctx, w.cfg.Role, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, engineFailure(w.cfg.Role, resp.StatusCode, raw, retryAfter(resp.Header.Get("Retry-After")))
	}
	return resp, nil
}

// notRun is an engine's failure that says it did not run the request: the
// connection was refused, or it answered 503 or 429, perhaps with a
// Retry-After. A decode engine so refused has not read the handoff's KV.
type notRun struct {
	err error
	// retryAfter is the engine's Retry-After, 0 when it sent none.
	retryAfter time.Duration
	// status is the engine's answer (503, 429); 0 for no connection.
	status int
}

// surely reports whether the engine surely did not run the call. A
// refused connection and a 429 say so. A 503 does on a streamed call,
// whose errors come in the stream once the engine has begun, or with a
// Retry-After; without one, on a call answered whole, it may be a proxy's
// "upstream reset" after the engine began, and so read a handoff's KV.
func (e *notRun) surely(streamed bool) bool {
	return e.status != http.StatusServiceUnavailable || streamed || e.retryAfter > 0
}

// neverRan reports whether a failed engine call was surely never run, so
// that a handoff's KV is unread: a refusal that says so (notRun), or, on a
// streamed call, any error status, since an engine answers a stream's
// errors in the stream once it has begun.
func neverRan(err error, streamed bool) bool {
	var refused *notRun
	if errors.As(err, &refused) && refused.surely(streamed) {
		return true
	}
	var fault *engineFault
	return streamed && errors.As(err, &fault) && fault.status != 0
}

func (e *notRun) Error() string { return e.err.Error() }
func (e *notRun) Unwrap() error { return e.err }

// retryAfter reads a Retry-After header: seconds, or an HTTP date; 0 when
// absent or unreadable.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if secs, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
		return time.Duration(max(secs, 0)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// engineFailure classifies a non-2xx engine answer: 429 and 5xx are
// transient, and retried; 401, 403 and 404 mean a worker set up wrong for
// its engine, and are retried on prefill but end a decode at once; any
// other 4xx is the client's and goes back to it with the engine's status
// and message.
func engineFailure(role dispatcher.Stage, status int, body []byte, wait time.Duration) error {
	apiErr, ok := openai.ParseError(body)
	if !ok {
		apiErr = openai.NewError(status, "%s engine answered %d: %s", role, status, truncate(string(body), 200))
	}
	err := fmt.Errorf("%s engine answered %d: %s", role, status, apiErr.Message)
	switch {
	case status == http.StatusTooManyRequests:
		return stage.Retryable(&notRun{err: err, retryAfter: wait, status: status}, openai.NewError(http.StatusServiceUnavailable, "%s engine busy: %s", role, apiErr.Message))
	case status == http.StatusServiceUnavailable:
		return stage.Retryable(&engineFault{err: &notRun{err: err, retryAfter: wait, status: status}, status: status},
			openai.NewError(http.StatusServiceUnavailable, "%s engine busy: %s", role, apiErr.Message))
	case status >= 500:
		return stage.Retryable(&engineFault{err: err, status: status}, openai.NewError(http.StatusBadGateway, "%s engine failed: %s", role, apiErr.Message))
	case status == http.StatusUnauthorized || status == http.StatusForbidden || status == http.StatusNotFound:
		// Not the client's doing: the worker is set up wrong for its engine
		// (a key, a route, a model). A prefill is retried, then kept for
		// replay; a decode ends at once (a retry would prefill again), with
		// its KV released, since the engine refused before reading it.
		e := openai.NewError(http.StatusBadGateway, "%s engine refused pdq (%d): %s", role, status, apiErr.Message)
		if role == dispatcher.StageDecode {
			return stage.Rejected(err, e)
		}
		return stage.Retryable(err, e)
	case status >= 400:
		apiErr.Code, apiErr.Type = status, openai.ErrorType(status)
		return stage.Rejected(err, apiErr)
	}
	return stage.Retryable(err, openai.NewError(http.StatusBadGateway, "%s engine answered %d", role, status))
}

// errTimedOut is the cause of an engine call cut off by a role deadline.
var errTimedOut = errors.New("engine deadline passed")

// timedOut is the failure of an engine call that took longer than its
// role allows: retryable, on another engine if one is free.
func timedOut(role dispatcher.Stage, what string, limit time.Duration) error {
	return stage.Retryable(&engineFault{err: fmt.Errorf("%s engine: %s: no answer within %v", role, what, limit)},
		openai.NewError(http.StatusGatewayTimeout, "%s engine did not answer within %v", role, limit))
}

// unreachable is the failure of an engine call that got no answer.
func unreachable(ctx context.Context, role dispatcher.Stage, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return stage.Retryable(&engineFault{err: err, unreachable: true}, openai.NewError(http.StatusBadGateway, "%s engine unreachable", role))
}

// engineFault is an engine failure that counts against its health, for
// the breaker: no answer (unreachable), a 5xx, a stage time-out.
type engineFault struct {
	err         error
	unreachable bool
	// status is the engine's answer (a 5xx); 0 when there was none.
	status int
}

func (e *engineFault) Error() string { return e.err.Error() }
func (e *engineFault) Unwrap() error { return e.err }

var errBadEnvelope = errors.New("job body is not a JSON object")

// badBody is the failure of a job whose body cannot be built into an
// engine request: no attempt can fix it.
func badBody(err error) error {
	return stage.Permanent(fmt.Errorf("%w: %w", errBadEnvelope, err), openai.NewError(http.StatusBadRequest, "request body: %v", err))
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
