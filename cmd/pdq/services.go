package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/workers"
)

// service parses a service command line (services take no flags, only
// PDQ_* variables) and loads the configuration and logger.
func service(name, summary string, args []string, stderr io.Writer) (config.Config, *slog.Logger, error) {
	fs := flag.NewFlagSet("pdq "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: pdq %s\n\n%s\n\nConfigured by PDQ_* environment variables; see the README.\n", name, summary)
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return config.Config{}, nil, flag.ErrHelp
		}
		return config.Config{}, nil, errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "pdq %s: unexpected arguments %q\n", name, fs.Args())
		return config.Config{}, nil, errUsage
	}
	cfg, err := config.Load()
	if err != nil {
		return config.Config{}, nil, err
	}
	log, err := logging.New(stderr, cfg.Log.Level, cfg.Log.Format)
	if err != nil {
		return config.Config{}, nil, err
	}
	// A mistyped name would be ignored in silence, and its setting with it.
	unknown, err := config.UnknownNames(os.Environ())
	if err != nil {
		return config.Config{}, nil, err
	}
	for _, u := range unknown {
		if u.Nearest != "" {
			log.Warn("unknown PDQ_ variable: ignored; did you mean "+u.Nearest+"?", "name", u.Name)
		} else {
			log.Warn("unknown PDQ_ variable: ignored (see the README for the known ones)", "name", u.Name)
		}
	}
	return cfg, log, nil
}

// connect joins the NATS at cfg.NATSURL with the PDQ_NATS_* credentials,
// retrying while it starts, and makes sure the streams and buckets exist:
// now, and again after every reconnect (a restarted server may have lost
// some) until ctx ends. Refused credentials or certificates end the
// retries at once: they will not get better.
func connect(ctx context.Context, cfg config.Config, name string, log *slog.Logger, extra ...nats.Option) (*nats.Conn, jetstream.JetStream, error) {
	url := cfg.NATSURL
	if url == "" {
		return nil, nil, fmt.Errorf("%w: PDQ_NATS_URL is required for pdq %s", config.ErrInvalid, name)
	}
	auth, err := natsAuth(cfg.NATS)
	if err != nil {
		return nil, nil, err
	}
	opts := append([]nats.Option{
		nats.Name("pdq " + name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(natsReconnectWait),
		nats.PingInterval(natsPingInterval),
		nats.MaxPingsOutstanding(natsMaxPingsOut),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err == nil { // closed by this process, at shutdown
				log.Debug("NATS connection closed")
				return
			}
			log.Warn("disconnected from NATS; reconnecting", logging.Err(err))
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("reconnected to NATS", "url", redactURLs(nc.ConnectedUrl())) }),
	}, append(auth, extra...)...)
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 5*time.Second, 0
	var nc *nats.Conn
	err = backoff.RetryNotify(func() error {
		var err error
		nc, err = nats.Connect(url, opts...)
		if permanent, hint := connectError(err); permanent {
			return backoff.Permanent(fmt.Errorf("%w (%s)", err, hint))
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		log.Warn("NATS not reachable; retrying", "url", redactURLs(url), logging.Err(err), "retry_in", next.Round(time.Millisecond).String())
	})
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w", redactURLs(url), err)
	}
	js, err := ensure(ctx, nc, cfg.NATS.Replicas, log)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	go func() {
		if err := dispatcher.KeepEnsured(ctx, js, topologyOptions(cfg.NATS.Replicas, log)...); err != nil {
			log.Error("streams and buckets will not be recreated after a NATS restart", logging.Err(err))
		}
	}()
	log.Info("connected to NATS", "url", redactURLs(nc.ConnectedUrl()), "replicas", cfg.NATS.Replicas)
	return nc, js, nil
}

// topologyOptions are the options of dispatcher.Ensure for this process.
func topologyOptions(replicas int, log *slog.Logger) []dispatcher.EnsureOption {
	return []dispatcher.EnsureOption{dispatcher.WithReplicas(replicas), dispatcher.WithLogger(log)}
}

// ensure creates the streams and buckets that are missing, with replicas
// copies; existing ones keep their settings (a difference is logged). It
// waits for JetStream as long as it takes, saying so: a cluster starting
// with pdq has no meta leader for its first seconds, and a process that
// gave up then would leave its pool a worker short. Only a setting the
// server can never take ends the wait.
func ensure(ctx context.Context, nc *nats.Conn, replicas int, log *slog.Logger) (jetstream.JetStream, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 250*time.Millisecond, 5*time.Second, 0
	start := time.Now()
	err = backoff.RetryNotify(func() error {
		ectx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		err := dispatcher.Ensure(ectx, js, topologyOptions(replicas, log)...)
		if hint := neverTaken(err, replicas); hint != "" {
			return backoff.Permanent(fmt.Errorf("%w (%s)", err, hint))
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		msg, level := "waiting for JetStream to create or find pdq's streams and buckets (a cluster elects its leaders first)", slog.LevelWarn
		if time.Since(start) > time.Minute {
			// Longer than any election: say what else it can be.
			msg, level = "still waiting for JetStream: is it enabled on the server, for this account, with room for pdq's streams?", slog.LevelError
		}
		log.Log(ctx, level, msg, logging.Err(err), "waited_s", int(time.Since(start).Seconds()), "retry_in", next.Round(time.Millisecond).String())
	})
	if err != nil {
		return nil, err
	}
	return js, nil
}

// neverTaken says what to fix when err is a JetStream refusal that waiting
// does not change (empty when it is not one): replicas on a server outside
// a cluster, or an account without JetStream, as the server says so.
func neverTaken(err error, replicas int) string {
	const (
		replicasNotSupported = 10074 // nats-server's JSStreamReplicasNotSupportedErr
		notEnabledForAccount = 10039 // JSNotEnabledForAccountErr
	)
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return ""
	}
	switch apiErr.ErrorCode {
	case replicasNotSupported:
		return fmt.Sprintf("PDQ_NATS_REPLICAS=%d needs a NATS cluster of as many servers", replicas)
	case notEnabledForAccount:
		return "enable JetStream for the account pdq's NATS user belongs to"
	}
	return ""
}

// drain flushes what the connection still holds and closes it.
func drain(nc *nats.Conn, log *slog.Logger) {
	if err := nc.Drain(); err != nil {
		log.Warn("NATS drain failed", logging.Err(err))
		nc.Close()
		return
	}
	for nc.IsDraining() {
		time.Sleep(10 * time.Millisecond)
	}
}

func gatewayConfig(cfg config.Config, reg prometheus.Gatherer, metrics *metrics) gateway.Config {
	return gateway.Config{
		Addr: cfg.HTTPAddr, APIKeys: cfg.APIKeys, OperatorKeys: cfg.OperatorKeys, MinPromptTokens: cfg.DisaggMinPromptTokens, Grace: cfg.ShutdownGrace,
		MaxBodyBytes:   config.MaxBodyBytes,
		RequestTimeout: cfg.RequestTimeout, MaxInflightBytes: cfg.MaxInflightBytes, MaxQueue: cfg.MaxQueue,
		StallTimeout: cfg.StallTimeout, PrefillFallback: cfg.PrefillFallback, BodyTimeout: cfg.BodyTimeout, Metrics: reg, Counters: metrics.gateway,
		Affinity: cfg.Affinity, FairQueue: cfg.FairQueue, FairLimit: cfg.FairLimit, TenantWeights: cfg.TenantWeights, FairLoad: config.FairLoad,
	}
}

// workerConfig is the configuration of a worker for one engine.
func workerConfig(cfg config.Config, role dispatcher.Stage, engineURL string, metrics *metrics) workers.Config {
	return workers.Config{
		Role: role, EngineURL: engineURL, EngineAPIKey: cfg.EngineAPIKey, Slots: cfg.EngineSlotsFor(role == dispatcher.StagePrefill),
		KVHost: cfg.KVHost, Grace: cfg.ShutdownGrace, RetryBase: config.RetryBase, ModelsRefresh: config.ModelsRefresh,
		KVTTL: cfg.KVTTL, MaxGenerations: cfg.MaxGenerations, AckWait: cfg.AckWait, MaxDeliver: cfg.MaxDeliver,
		PrefillTimeout: cfg.PrefillTimeout, StallTimeout: cfg.StallTimeout, BreakerFailures: cfg.BreakerFailures,
		PrefillFallback: cfg.PrefillFallback, MigrationLimit: cfg.MigrationLimit, Affinity: cfg.Affinity,
		Replicas: cfg.NATS.Replicas, Metrics: metrics.workers, EngineMetrics: metrics.engines,
	}
}

func runGateway(ctx context.Context, args []string, _, stderr io.Writer) error {
	cfg, log, err := service("gateway", "The OpenAI-facing gateway, joining the NATS at PDQ_NATS_URL.", args, stderr)
	if err != nil {
		return helpIsNoError(err)
	}
	// The gateway keeps nothing to send while it reconnects: a message
	// sent then fails at once, so that its client is refused with a 503
	// during an outage instead of waiting for it, and no claim or job the
	// client has given up on is sent when NATS is back (a claim so stored
	// kept its id a 409 until its deadline).
	nc, js, err := connect(ctx, cfg, "gateway", log, nats.ReconnectBufSize(-1))
	if err != nil {
		return err
	}
	defer drain(nc, log)
	reg := prometheus.NewRegistry()
	metrics, err := newMetrics(reg)
	if err != nil {
		return err
	}
	gw, err := gateway.New(nc, js, gatewayConfig(cfg, reg, metrics), log)
	if err != nil {
		return err
	}
	return gw.Run(ctx)
}

func runPrefill(ctx context.Context, args []string, _, stderr io.Writer) error {
	return runWorker(ctx, dispatcher.StagePrefill, args, stderr)
}

func runDecode(ctx context.Context, args []string, _, stderr io.Writer) error {
	return runWorker(ctx, dispatcher.StageDecode, args, stderr)
}

func runWorker(ctx context.Context, role dispatcher.Stage, args []string, stderr io.Writer) error {
	summary := fmt.Sprintf("A %s worker for the engine at PDQ_ENGINE_URL, joining the NATS at PDQ_NATS_URL.", role)
	cfg, log, err := service(string(role), summary, args, stderr)
	if err != nil {
		return helpIsNoError(err)
	}
	if cfg.EngineURL == "" {
		return fmt.Errorf("%w: PDQ_ENGINE_URL is required for pdq %s", config.ErrInvalid, role)
	}
	nc, js, err := connect(ctx, cfg, string(role), log)
	if err != nil {
		return err
	}
	defer drain(nc, log)
	reg := prometheus.NewRegistry()
	metrics, err := newMetrics(reg)
	if err != nil {
		return err
	}
	w, err := workers.New(nc, js, workerConfig(cfg, role, cfg.EngineURL, metrics), log)
	if err != nil {
		return err
	}
	if cfg.MetricsAddr == "" {
		return w.Run(ctx)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return serveMetrics(gctx, cfg.MetricsAddr, reg, nc, log) })
	g.Go(func() error { return w.Run(gctx) })
	return g.Wait()
}

// serveMetrics serves a lone worker's GET /metrics from reg on addr until
// ctx ends, with /health (the process runs) and /ready (its NATS
// connection is up) for an orchestrator's probes.
func serveMetrics(ctx context.Context, addr string, reg prometheus.Gatherer, nc *nats.Conn, log *slog.Logger) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics: listen on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /ready", func(w http.ResponseWriter, _ *http.Request) {
		if !nc.IsConnected() {
			http.Error(w, "not connected to NATS", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	log.Info("serving metrics", "addr", ln.Addr().String())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
}

func helpIsNoError(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}

// metrics are pdq's series, each component's next to it (the gateway's,
// the stage loops', the engines', and what both sides count in package
// dispatcher). Every process
// registers all of them, so that each exports the same series whatever
// it runs.
type metrics struct {
	gateway *gateway.Metrics
	workers *stage.Metrics
	engines *workers.Metrics
}

// newMetrics registers pdq's metrics with reg, and pdq_build_info: which
// build runs, for dashboards that compare versions during a rollout.
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	shared, err := dispatcher.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	gw, err := gateway.NewMetrics(reg, shared)
	if err != nil {
		return nil, err
	}
	w, err := stage.NewMetrics(reg, shared)
	if err != nil {
		return nil, err
	}
	e, err := workers.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	b := readBuildInfo()
	info := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdq_build_info", Help: "1, labelled with the running build's module version, commit (empty without VCS information) and Go version.",
	}, []string{"version", "revision", "goversion"})
	if err := reg.Register(info); err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	info.WithLabelValues(b.version, b.revision, runtime.Version()).Set(1)
	return &metrics{gateway: gw, workers: w, engines: e}, nil
}
