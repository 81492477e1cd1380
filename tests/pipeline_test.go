package tests

import (
	"context"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/workers"
)

// pipeline is pdq running in the test process: an embedded JetStream, a
// gateway on a loopback port, and a worker per simulated engine.
type pipeline struct {
	url     string // the gateway's base URL
	prefill []*simtest.Engine
	decode  []*simtest.Engine
	nc      *nats.Conn
	js      jetstream.JetStream
	log     *slog.Logger
	ctx     context.Context
	wg      *sync.WaitGroup
	t       testing.TB
	worker  workers.Config // what every worker's configuration starts from
}

type pipelineOptions struct {
	prefill, decode int              // engines of each kind, default 1; -1 for none
	sim             simconfig.Config // engine configuration, default simtest.FastConfig
	prefillSim      *simconfig.Config
	gateway         gateway.Config
	slots           int            // per worker; 0 takes the role's default
	worker          workers.Config // settings of every worker beyond the defaults
	// local hands replies from the workers to the gateway in memory, as
	// pdq up does (reply.LocalReplies); they go over NATS otherwise.
	local bool
}

// testLogger writes logs to stderr when PDQ_TEST_LOG is set; tests are
// quiet otherwise.
func testLogger() *slog.Logger {
	if level := os.Getenv("PDQ_TEST_LOG"); level != "" {
		log, err := logging.New(os.Stderr, level, logging.FormatText)
		if err == nil {
			return log
		}
	}
	return logging.Discard()
}

func startPipeline(t testing.TB, o pipelineOptions) *pipeline {
	t.Helper()
	if o.prefill == 0 {
		o.prefill = 1
	}
	if o.decode == 0 {
		o.decode = 1
	}
	if o.sim.Model == "" {
		o.sim = simtest.FastConfig()
	}
	log := testLogger()
	nc := embeddedtest.Conn(t, log)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := dispatcher.Ensure(ctx, js); err != nil {
		t.Fatal(err)
	}
	p := &pipeline{nc: nc, js: js, log: log, ctx: ctx, wg: &sync.WaitGroup{}, t: t, worker: o.worker}
	gcfg := o.gateway
	if o.local {
		p.worker.LocalReplies = reply.NewLocalReplies()
		gcfg.LocalReplies = p.worker.LocalReplies
	}
	t.Cleanup(func() {
		cancel()
		p.wg.Wait()
	})
	for range max(o.prefill, 0) {
		cfg := o.sim
		if o.prefillSim != nil {
			cfg = *o.prefillSim
		}
		p.prefill = append(p.prefill, simtest.Start(t, cfg))
	}
	for range max(o.decode, 0) {
		p.decode = append(p.decode, simtest.Start(t, o.sim))
	}
	for _, e := range p.prefill {
		p.startWorker(dispatcher.StagePrefill, e.URL, o.slots)
	}
	for _, e := range p.decode {
		p.startWorker(dispatcher.StageDecode, e.URL, o.slots)
	}
	if gcfg.MinPromptTokens == 0 {
		gcfg.MinPromptTokens = config.DefaultDisaggMinPromptTokens
	}
	gcfg.Grace = 2 * time.Second
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gw, err := gateway.New(nc, js, gatewaySettings(gcfg), log)
	if err != nil {
		t.Fatal(err)
	}
	p.run("gateway", func() error { return gw.Serve(ctx, ln) })
	p.url = "http://" + ln.Addr().String()
	p.waitWorkers(max(o.prefill, 0) + max(o.decode, 0))
	return p
}

// startWorker runs one more worker for the engine at url.
func (p *pipeline) startWorker(role dispatcher.Stage, url string, slots int) {
	p.t.Helper()
	cfg := p.worker
	cfg.Role, cfg.EngineURL, cfg.Slots, cfg.Grace, cfg.RetryBase = role, url, slots, 2*time.Second, 20*time.Millisecond
	w, err := workers.New(p.nc, p.js, workerSettings(cfg), p.log)
	if err != nil {
		p.t.Fatal(err)
	}
	p.run(string(role)+" worker", func() error { return w.Run(p.ctx) })
}

func (p *pipeline) run(what string, f func() error) {
	p.wg.Go(func() {
		if err := f(); err != nil {
			p.t.Errorf("%s stopped with %v", what, err)
		}
	})
}

// waitWorkers waits until n workers are in the registry, so requests do
// not race the workers' start-up.
func (p *pipeline) waitWorkers(n int) {
	p.t.Helper()
	kv, err := p.js.KeyValue(p.ctx, dispatcher.BucketWorkers)
	if err != nil {
		p.t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		keys, _ := kv.Keys(p.ctx)
		if len(keys) >= n {
			// The gateway's watch sees the entries a moment later.
			time.Sleep(50 * time.Millisecond)
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%d of %d workers registered after 10s", len(keys), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// chat and completions are the gateway's endpoint URLs.
func (p *pipeline) chat() string        { return p.url + "/v1/chat/completions" }
func (p *pipeline) completions() string { return p.url + "/v1/completions" }

// gatewaySettings is cfg with every setting config gives a gateway, where
// the test left it unset: gateway.New fills in none.
func gatewaySettings(cfg gateway.Config) gateway.Config {
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{
		{&cfg.StallTimeout, config.DefaultStallTimeout}, {&cfg.Grace, config.DefaultShutdownGrace},
		{&cfg.RequestTimeout, config.DefaultRequestTimeout}, {&cfg.BodyTimeout, config.DefaultBodyTimeout},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = config.MaxBodyBytes
	}
	if cfg.MaxInflightBytes == 0 {
		cfg.MaxInflightBytes = config.DefaultMaxInflightBytes
	}
	if cfg.MaxQueue == 0 {
		cfg.MaxQueue = config.DefaultMaxQueue
	}
	if cfg.PrefillFallback == "" {
		cfg.PrefillFallback = config.FallbackDecode
	}
	return cfg
}

// workerSettings is cfg with every setting config gives a worker, where
// the test left it unset: workers.New fills in none.
func workerSettings(cfg workers.Config) workers.Config {
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{
		{&cfg.Grace, config.DefaultShutdownGrace}, {&cfg.RetryBase, config.RetryBase}, {&cfg.AckWait, config.DefaultAckWait},
		{&cfg.KVTTL, config.DefaultKVTTL}, {&cfg.PrefillTimeout, config.DefaultPrefillTimeout},
		{&cfg.StallTimeout, config.DefaultStallTimeout}, {&cfg.ModelsRefresh, config.ModelsRefresh},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct {
		v   *int
		def int
	}{
		{&cfg.MaxGenerations, config.DefaultMaxGenerations}, {&cfg.MaxDeliver, config.DefaultMaxDeliver},
		{&cfg.BreakerFailures, config.DefaultBreakerFailures},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if cfg.Slots == 0 {
		cfg.Slots = config.DefaultDecodeSlots
		if cfg.Role == dispatcher.StagePrefill {
			cfg.Slots = config.DefaultPrefillSlots
		}
	}
	return cfg
}
