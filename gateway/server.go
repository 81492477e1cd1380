package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/admin"
	"github.com/pdq-dev/pdq/dispatcher/affinity"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Config configures a gateway.
type Config struct {
	// Addr is the listen address of Run.
	Addr string
	// APIKeys, when set, are the bearer tokens accepted on /v1. A key reads
	// the records of its own requests only.
	APIKeys []string
	// OperatorKeys are bearer tokens accepted on /v1 too, whose holders
	// read every request's record (PDQ_OPERATOR_KEYS).
	OperatorKeys []string
	// MinPromptTokens to MaxQueue are required: config gives each, and
	// New fills in none (MinPromptTokens' 0 has a meaning of its own).
	//
	// MinPromptTokens is the P/D threshold (PDQ_DISAGG_MIN_PROMPT_TOKENS);
	// 0 sends every request through prefill.
	MinPromptTokens int
	// MaxBodyBytes bounds a request body (config.MaxBodyBytes), and is
	// bounded by MaxInflightBytes.
	MaxBodyBytes int64
	// StallTimeout fails a request whose running decode is silent this
	// long: no chunk and no heartbeat (PDQ_STALL_TIMEOUT).
	StallTimeout time.Duration
	// PrefillFallback is decode (long prompts go decode-only while the
	// pool has no healthy prefill worker) or fail (they get a 503).
	PrefillFallback string
	// Affinity prefers, for each prefill, the engine whose prefix cache
	// likely holds its prompt's start (PDQ_AFFINITY; see affinity.Placer).
	Affinity bool
	// FairQueue holds what a pool cannot start yet in the gateway, in
	// priority and tenant order (PDQ_FAIR_QUEUE; see package fair), with
	// TenantWeights (PDQ_TENANT_WEIGHTS).
	FairQueue     bool
	TenantWeights map[string]float64
	// FairLimit is what a pool holds before the fair queue holds its
	// requests (PDQ_FAIR_LIMIT): config.FairLimitSlots or
	// config.FairLimitEngines, whose FairLoad is the prompt tokens an
	// engine's worth of requests may hold before they start
	// (config.FairLoad).
	FairLimit string
	FairLoad  int
	Grace     time.Duration
	// RequestTimeout is every request's deadline, carried by its jobs.
	RequestTimeout time.Duration
	// BodyTimeout bounds the read of a request body (PDQ_BODY_TIMEOUT): a
	// client that stops sending it gets a 408, and its connection and
	// reserved bytes go.
	BodyTimeout time.Duration
	// MaxInflightBytes bounds the request bodies held at once; a request
	// that does not fit gets a 429.
	MaxInflightBytes int64
	// MaxQueue bounds the jobs waiting in one pool's stage; past it, a
	// request gets a 429 with a Retry-After derived from the depth.
	MaxQueue int
	// Metrics is what GET /metrics serves; nil serves an empty set.
	Metrics prometheus.Gatherer
	// Counters counts the gateway's prefill fallbacks; nil counts nothing.
	Counters *Metrics
	// LocalReplies, when set, lets the workers of this process (pdq up)
	// hand this gateway their replies without NATS.
	LocalReplies *reply.LocalReplies
}

// check refuses a config without a setting the gateway needs: every one
// comes from config, where the defaults are.
func (c *Config) check() error {
	for _, d := range []struct {
		name string
		ok   bool
	}{
		{"P/D threshold", c.MinPromptTokens >= 0}, {"body limit", c.MaxBodyBytes > 0}, {"stall time-out", c.StallTimeout > 0},
		{"shutdown grace", c.Grace > 0}, {"request time-out", c.RequestTimeout > 0}, {"body time-out", c.BodyTimeout > 0},
		{"in-flight bytes", c.MaxInflightBytes > 0}, {"queue bound", c.MaxQueue > 0}, {"fair queue's limit", !c.FairQueue || c.FairLimit == config.FairLimitSlots || c.FairLimit == config.FairLimitEngines && c.FairLoad > 0},
		{"prefill fallback", c.PrefillFallback == config.FallbackDecode || c.PrefillFallback == config.FallbackFail},
	} {
		if !d.ok {
			return fmt.Errorf("gateway: no valid %s (config gives every setting)", d.name)
		}
	}
	return nil
}

// Server is the OpenAI-facing gateway.
type Server struct {
	cfg Config
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger
	id  string
}

// New checks cfg and builds a gateway; Run or Serve starts it.
func New(nc *nats.Conn, js jetstream.JetStream, cfg Config, log *slog.Logger) (*Server, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	cfg.MaxBodyBytes = min(cfg.MaxBodyBytes, cfg.MaxInflightBytes)
	id := newUUID()[:8]
	return &Server{cfg: cfg, nc: nc, js: js, id: id,
		log: log.With(logging.KeyComponent, "gateway", "gateway_id", id)}, nil
}

// Run listens on the configured address and serves until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("gateway: listen: %w", err)
	}
	return s.Serve(ctx, ln)
}

// Serve serves on ln until ctx ends, then lets running requests finish
// within the grace period.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	defer ln.Close()
	reg, err := registry.WatchWorkers(ctx, s.js, s.log)
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	if err := reg.WaitSynced(ctx); err != nil {
		return fmt.Errorf("gateway: read the worker registry: %w", err)
	}
	// Waited for while JetStream does not answer, as a bucket's group
	// elects its leader in a cluster's first seconds.
	var records *dispatcher.Records
	err = dispatcher.UntilAnswered(ctx, s.log, "the request records", func(ctx context.Context) (err error) {
		records, err = dispatcher.OpenRecords(ctx, s.js)
		return err
	})
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	replies, err := reply.NewReplies(s.nc, s.id)
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	defer replies.Close()
	unshare := s.cfg.LocalReplies.Add(replies)
	defer unshare()
	// Workers ask whether this gateway still holds its clients; once it
	// stops answering, they stop working for them.
	pings, err := registry.AnswerPings(s.nc, s.id)
	if err != nil {
		return fmt.Errorf("gateway: answer liveness pings: %w", err)
	}
	defer pings.Unsubscribe()
	// Bodies and the replies waiting for their clients share one budget.
	budget := newByteBudget(s.cfg.MaxInflightBytes, s.cfg.Counters)
	replies.SetBudget(budget)
	// The ledger outlives the grace period: the last requests' ends are
	// written after their relays stop.
	ledgerCtx, stopLedger := context.WithCancel(context.Background())
	ledgerDone := make(chan struct{})
	led := submit.NewLedger(s.nc, records, lastWords, s.log)
	go func() { led.Run(ledgerCtx); close(ledgerDone) }()
	defer func() { stopLedger(); <-ledgerDone }()
	// The store doctor rebuilds a stream whose store stopped writing (a
	// full disk), once it can write again.
	doctor := admin.NewStoreDoctor(s.js, records, s.cfg.Counters.Shared(), s.log)
	doctorCtx, stopDoctor := context.WithCancel(ctx)
	doctorDone := make(chan struct{})
	go func() { doctor.Run(doctorCtx); close(doctorDone) }()
	defer func() { stopDoctor(); <-doctorDone }()
	h := &handlers{Server: s, registry: reg, replies: replies, records: records, relays: newRelays(), ledger: led, doctor: doctor,
		submitter: submit.NewSubmitter(s.js, records, registry.NewLiveness(s.nc)),
		budget:    budget,
		admission: submit.NewAdmission(s.js, s.cfg.MaxQueue)}
	if s.cfg.Affinity {
		h.placer, h.decodePlacer = affinity.NewPlacer(), affinity.NewDecodePlacer()
	}
	srv := &http.Server{
		Handler:           h.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("gateway listening", "addr", ln.Addr().String())
	select {
	case err := <-errc:
		return fmt.Errorf("gateway: serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), s.cfg.Grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		// The relays still running end with an error, so that each client
		// hears why instead of having its connection cut.
		s.log.Warn("shutdown grace over: ending the running requests with an error", logging.Err(err))
		h.relays.end()
		fctx, fcancel := context.WithTimeout(context.Background(), lastWords)
		if err := srv.Shutdown(fctx); err != nil {
			s.log.Warn("closing the connections of requests still running", logging.Err(err))
			srv.Close()
		}
		fcancel()
	}
	s.log.Info("gateway stopped")
	return nil
}

// lastWords bounds the wait, once the grace period is over, for the
// running requests to record their end and write their error, and the
// ledger's last writes.
const lastWords = 3 * time.Second

// handlers hold what the routes share once the gateway is serving.
type handlers struct {
	*Server
	// relays are the relays running, ended when the shutdown grace
	// period runs out.
	relays   *relays
	registry *registry.Registry
	replies  *reply.Replies
	records  *dispatcher.Records
	// ledger keeps the record writes NATS did not take, until it does.
	ledger *submit.Ledger
	// doctor knows which streams do not store.
	doctor    *admin.StoreDoctor
	submitter *submit.Submitter
	budget    *byteBudget
	admission *submit.Admission
	// placer picks prefill jobs' preferred engines, decodePlacer decode
	// jobs'; nil with affinity off.
	placer, decodePlacer *affinity.Placer
	// queues are the pools' fair queues (pool name → *fair.Queue), made
	// as pools are first asked for; none with PDQ_FAIR_QUEUE off.
	queues sync.Map
	// fallingBack holds the pools whose long prompts go decode-only for
	// want of a healthy prefill worker, to log each change once.
	fallingBack sync.Map
}

func (h *handlers) routes() http.Handler {
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = h.echoError
	e.Use(h.recoverPanics)
	// The key check is per route, not group middleware: a group with
	// middleware answers 404 where a wrong method deserves a 405.
	e.POST("/v1/chat/completions", h.generate(openai.Chat), h.track, h.requireKey)
	e.POST("/v1/completions", h.generate(openai.Completions), h.track, h.requireKey)
	e.GET("/v1/models", h.models, h.requireKey)
	e.GET("/v1/requests/:id", h.request, h.requireKey)
	e.POST("/v1/embeddings", h.engineCall, h.requireKey)
	e.POST("/tokenize", h.engineCall, h.requireKey)
	e.POST("/detokenize", h.engineCall, h.requireKey)
	e.GET("/version", h.engineCall, h.requireKey)
	e.GET("/health", func(c echo.Context) error { return c.NoContent(http.StatusOK) })
	metrics := h.cfg.Metrics
	if metrics == nil {
		metrics = prometheus.NewRegistry()
	}
	e.GET("/metrics", echo.WrapHandler(promhttp.HandlerFor(metrics, promhttp.HandlerOpts{})))
	e.GET("/ready", h.ready)
	return e
}

// writeError answers with an OpenAI error envelope.
func writeError(c echo.Context, apiErr *openai.Error) error {
	body, err := apiErr.Envelope()
	if err != nil {
		return err
	}
	return c.Blob(apiErr.Status(), echo.MIMEApplicationJSON, body)
}

// echoError turns echo's own errors (no route, wrong method) into OpenAI
// envelopes.
func (h *handlers) echoError(err error, c echo.Context) {
	if c.Response().Committed {
		return
	}
	status := http.StatusInternalServerError
	msg := "internal error"
	var he *echo.HTTPError
	if errors.As(err, &he) {
		status = he.Code
		msg = fmt.Sprint(he.Message)
	} else {
		h.log.Error("handler failed", logging.Err(err), "path", c.Path())
	}
	if err := writeError(c, openai.NewError(status, "%s", msg)); err != nil {
		h.log.Debug("could not write an error response", logging.Err(err))
	}
}

// recoverPanics answers 500 instead of dropping the connection, and logs
// the panic: a panic is a bug, never a client's doing.
func (h *handlers) recoverPanics(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) (err error) {
		defer func() {
			if r := recover(); r != nil {
				if r == http.ErrAbortHandler {
					panic(r)
				}
				h.log.Error("panic in handler", "panic", fmt.Sprint(r), "path", c.Path())
				err = writeError(c, openai.NewError(http.StatusInternalServerError, "internal error"))
			}
		}()
		return next(c)
	}
}
