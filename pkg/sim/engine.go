package sim

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/sim/kvstore"
	"github.com/pdq-dev/pdq/pkg/sim/sched"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

// shutdownGrace is how long Serve waits for running requests at shutdown
// before it closes their connections.
const shutdownGrace = 5 * time.Second

// Engine is one simulated vLLM engine: an OpenAI HTTP server plus the KV
// side channel. It plays either leg of a P/D pair, or both, depending on
// each request's kv_transfer_params, as a vLLM engine with kv_role kv_both.
type Engine struct {
	cfg      simconfig.Config
	log      *slog.Logger
	names    *modelNames
	engineID string
	compat   string

	stats  counters
	dead   atomic.Bool
	kv     *kvstore.Store
	faults *simconfig.FaultInjector
	slots  chan struct{}
	// batch runs requests through the scheduler model (--profile); nil
	// on an engine of fixed latencies.
	batch    *sched.Batcher
	kvPort   atomic.Int64
	registry *prometheus.Registry
	recorder *recorder
	handler  http.Handler
}

// New validates cfg and builds an engine. It does not listen yet.
func New(cfg simconfig.Config, log *slog.Logger) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("sim config: %w", err)
	}
	e := &Engine{
		cfg:      cfg,
		log:      log.With(logging.KeyComponent, "sim", "model", cfg.Model),
		names:    newModelNames(cfg),
		engineID: cfg.EngineID,
		slots:    make(chan struct{}, cfg.MaxNumSeqs),
	}
	if e.engineID == "" {
		e.engineID = randomHex(16)
	}
	// Engines pair only with engines of the same model, block size and
	// protocol, as vLLM's compatibility hash demands matching builds.
	sum := sha256.Sum256([]byte(fmt.Sprintf("pdq-sim|%s|%d|%s", cfg.Model, cfg.BlockSize, cfg.Protocol)))
	e.compat = hex.EncodeToString(sum[:8])
	e.kv = kvstore.New(e.log, &e.stats.kv, cfg.KVLease)
	if cfg.Batched() {
		scfg, perBlock, perRead := cfg.Sched()
		var err error
		// The batcher sets the engine's running and waiting gauges.
		e.batch, err = sched.NewBatcher(scfg, perBlock, perRead, func(running, waiting int) {
			e.stats.running.Store(int64(running))
			e.stats.waiting.Store(int64(waiting))
		})
		if err != nil {
			return nil, fmt.Errorf("sim config: %w", err)
		}
	}
	e.faults = simconfig.NewFaultInjector(cfg.Fault, cfg.Seed)
	e.kvPort.Store(int64(cfg.KVPort))
	e.registry = e.newRegistry()
	e.recorder = newRecorder()
	e.handler = e.routes()
	return e, nil
}

// Run listens on the configured HTTP address and side-channel host and port,
// and serves until ctx ends.
func (e *Engine) Run(ctx context.Context) error {
	var lc net.ListenConfig
	httpLn, err := lc.Listen(ctx, "tcp", e.cfg.Addr)
	if err != nil {
		return fmt.Errorf("sim: listen http: %w", err)
	}
	kvLn, err := lc.Listen(ctx, "tcp", net.JoinHostPort(e.cfg.KVHost, strconv.Itoa(e.cfg.KVPort)))
	if err != nil {
		httpLn.Close()
		return fmt.Errorf("sim: listen kv side channel: %w", err)
	}
	return e.Serve(ctx, httpLn, kvLn)
}

// Serve serves HTTP on httpLn and the side channel on kvLn until ctx ends,
// then shuts down gracefully. It closes both listeners. The advertised
// remote_port is kvLn's port; remote_host stays Config.KVHost.
func (e *Engine) Serve(ctx context.Context, httpLn, kvLn net.Listener) error {
	if addr, ok := kvLn.Addr().(*net.TCPAddr); ok {
		e.kvPort.Store(int64(addr.Port))
	}
	srv := &http.Server{
		Handler:           e.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(e.log.Handler(), slog.LevelDebug),
	}
	kvCtx, stopKV := context.WithCancel(context.WithoutCancel(ctx))
	defer stopKV()

	errc := make(chan error, 2)
	go func() {
		if err := srv.Serve(httpLn); !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("sim: serve http: %w", err)
			return
		}
		errc <- nil
	}()
	go func() { errc <- e.serveKV(kvCtx, kvLn) }()
	e.log.Info("simulated engine ready",
		"addr", httpLn.Addr().String(), "kv", net.JoinHostPort(e.cfg.KVHost, strconv.Itoa(e.KVPort())),
		"served_model_name", e.names.served, "runner", e.cfg.Runner,
		"engine_id", e.engineID, "nixl_protocol", e.cfg.Protocol, "kv_load_failure", e.cfg.KVLoadFailure,
		"max_num_seqs", e.cfg.MaxNumSeqs, "kv_lease", e.cfg.KVLease.String(), "profile", e.cfg.Profile)

	var first error
	pending := cap(errc)
	select {
	case <-ctx.Done():
	case first = <-errc: // a listener failed: shut the other down too
		pending--
	}
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	stopKV()
	for ; pending > 0; pending-- {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	e.kv.Close()
	e.log.Info("simulated engine stopped")
	return first
}

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats { return e.snapshot() }

// KVPort is the side channel's port: the bound one once Serve runs.
func (e *Engine) KVPort() int { return int(e.kvPort.Load()) }

// SetFault changes the injected fault.
func (e *Engine) SetFault(f simconfig.Fault) error {
	if err := f.Validate(); err != nil {
		return err
	}
	e.faults.Set(f)
	return nil
}

// die marks the engine dead, as vLLM's EngineCore dies on an exception in
// its scheduler: every request from now on fails and /health answers 503.
func (e *Engine) die(requestID string, cause error) {
	if e.dead.CompareAndSwap(false, true) {
		e.log.Error("EngineCore died: KeyError in _update_from_kv_xfer_finished; the engine must be restarted",
			logging.KeyRequestID, requestID, logging.Err(cause))
	}
}

func randomHex(nbytes int) string {
	b := make([]byte, nbytes)
	rand.Read(b) // never fails (crypto/rand, Go 1.24+)
	return hex.EncodeToString(b)
}
