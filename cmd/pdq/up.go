package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/nats/embedded"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/workers"
)

// runUp runs everything in one process: NATS (embedded unless PDQ_NATS_URL
// names one), the gateway, and a worker per engine; with no engines
// configured, a simulated prefill and decode engine too.
func runUp(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, log, err := service("up", "Everything in one process: embedded NATS, gateway, prefill and decode workers,\nand simulated engines when PDQ_PREFILL_ENGINES and PDQ_DECODE_ENGINES are unset.", args, stderr)
	if err != nil {
		return helpIsNoError(err)
	}
	if (len(cfg.PrefillEngines) == 0) != (len(cfg.DecodeEngines) == 0) {
		return fmt.Errorf("%w: set both PDQ_PREFILL_ENGINES and PDQ_DECODE_ENGINES, or neither (for simulated engines)", config.ErrInvalid)
	}

	var (
		nc       *nats.Conn
		js       jetstream.JetStream
		natsNote string
	)
	if cfg.NATSURL != "" {
		if nc, js, err = connect(ctx, cfg, "up", log); err != nil {
			return err
		}
		natsNote = redactURLs(cfg.NATSURL)
	} else {
		listen, why := natsListen(cfg, log)
		srv, err := embedded.Start(embedded.Options{DataDir: filepath.Join(cfg.DataDir, "nats"), Listen: listen,
			User: cfg.NATS.User, Password: cfg.NATS.Password, Token: cfg.NATS.Token}, log)
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		opts := []nats.Option{nats.Name("pdq up")}
		switch {
		case cfg.NATS.User != "":
			opts = append(opts, nats.UserInfo(cfg.NATS.User, cfg.NATS.Password))
		case cfg.NATS.Token != "":
			opts = append(opts, nats.Token(cfg.NATS.Token))
		}
		if nc, err = srv.Connect(opts...); err != nil {
			return err
		}
		if js, err = ensure(ctx, nc, cfg.NATS.Replicas, log); err != nil {
			nc.Close()
			return err
		}
		natsNote = "embedded, in-process only (" + why + "): the tools cannot join"
		switch url := srv.ClientURL(); {
		case url == nats.DefaultURL:
			natsNote = "embedded, at " + url + ": the tools (pdq status, requests, replay) join it as they are;\n" +
				"           other processes with PDQ_NATS_URL=" + url
		case url != "":
			natsNote = "embedded, at " + url + ": tools join it with --nats " + url + ",\n" +
				"           other processes with PDQ_NATS_URL=" + url
		}
		log.Info("embedded NATS with JetStream started", "data_dir", filepath.Join(cfg.DataDir, "nats"), "client_url", srv.ClientURL())
	}
	defer drain(nc, log)

	gwLn, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("gateway: listen on %s: %w", cfg.HTTPAddr, err)
	}
	// One set of metrics for the whole process, served by the gateway.
	reg := prometheus.NewRegistry()
	metrics, err := newMetrics(reg)
	if err != nil {
		gwLn.Close()
		return err
	}
	// The workers hand the gateway their reply chunks in memory.
	local := reply.NewLocalReplies()
	gcfg := gatewayConfig(cfg, reg, metrics)
	gcfg.LocalReplies = local
	gw, err := gateway.New(nc, js, gcfg, log)
	if err != nil {
		gwLn.Close()
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	prefill, decode := cfg.PrefillEngines, cfg.DecodeEngines
	simulated := len(prefill) == 0
	if simulated {
		p, err := startSim(gctx, g, cfg.EngineAPIKey, log)
		if err != nil {
			gwLn.Close()
			return err
		}
		d, err := startSim(gctx, g, cfg.EngineAPIKey, log)
		if err != nil {
			gwLn.Close()
			return err
		}
		prefill, decode = []string{p}, []string{d}
		log.Info("no engines configured: started a simulated prefill and decode engine (pdq sim)", "prefill", p, "decode", d)
	}
	for _, eng := range []struct {
		role dispatcher.Stage
		urls []string
	}{{dispatcher.StagePrefill, prefill}, {dispatcher.StageDecode, decode}} {
		for _, url := range eng.urls {
			wcfg := workerConfig(cfg, eng.role, url, metrics)
			wcfg.LocalReplies = local
			w, err := workers.New(nc, js, wcfg, log)
			if err != nil {
				gwLn.Close()
				return err
			}
			g.Go(func() error { return w.Run(gctx) })
		}
	}
	g.Go(func() error { return gw.Serve(gctx, gwLn) })

	// Say "up" once the workers can take requests, so the curl line works
	// when it is printed; engines that are still starting only delay it.
	want := len(prefill) + len(decode)
	got, models := waitRegistered(gctx, js, want, 15*time.Second)
	if got < want {
		log.Warn("not every worker is registered yet; their engines may still be starting", "registered", got, "workers", want)
	}
	base := "http://" + displayAddr(gwLn.Addr())
	fmt.Fprintf(stdout, "pdq is up: OpenAI API at %s/v1\n", base)
	fmt.Fprintf(stdout, "  engines: %d prefill, %d decode%s\n", len(prefill), len(decode), map[bool]string{true: " (simulated)", false: ""}[simulated])
	fmt.Fprintf(stdout, "  NATS:    %s\n", natsNote)
	fmt.Fprint(stdout, tryLine(base, models, len(cfg.APIKeys) > 0))
	return g.Wait()
}

// tryPrompt is long enough (about 25 tokens, estimated as the gateway
// does) to go through prefill and decode at PDQ_DISAGG_MIN_PROMPT_TOKENS'
// default; a shorter one is prefilled by the decode engine alone.
const tryPrompt = "Explain in one paragraph why large language model serving runs prefill and decode on separate engines."

// tryLine is the request pdq up suggests: one that works as printed, for
// a model its engines serve, with an API key when the gateway wants one (a
// placeholder: keys are not printed).
func tryLine(base string, models []string, keys bool) string {
	model := "<model>" // no worker registered yet
	if len(models) > 0 {
		model = models[0]
	}
	body, _ := json.Marshal(map[string]any{ // plain values: it always encodes
		"model": model, "messages": []map[string]string{{"role": "user", "content": tryPrompt}},
		"max_tokens": 64, "stream": true,
	})
	var b strings.Builder
	fmt.Fprintf(&b, "Try:\n  curl -sN %s/v1/chat/completions -H 'Content-Type: application/json' \\\n", base)
	if keys {
		b.WriteString("    -H 'Authorization: Bearer <one of PDQ_API_KEYS>' \\\n")
	}
	fmt.Fprintf(&b, "    -d '%s'\n", body)
	if len(models) > 1 {
		fmt.Fprintf(&b, "  (models served: %s)\n", strings.Join(models, ", "))
	}
	return b.String()
}

// startSim runs a simulated engine on free loopback ports and returns its
// URL. It requires apiKey, when set, as an engine started with --api-key
// does.
func startSim(ctx context.Context, g *errgroup.Group, apiKey string, log *slog.Logger) (string, error) {
	cfg := simconfig.DefaultConfig()
	cfg.KVHost = "127.0.0.1"
	cfg.APIKey = apiKey
	engine, err := sim.New(cfg, log)
	if err != nil {
		return "", err
	}
	httpLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("simulated engine: %w", err)
	}
	kvLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		httpLn.Close()
		return "", fmt.Errorf("simulated engine: %w", err)
	}
	g.Go(func() error { return engine.Serve(ctx, httpLn, kvLn) })
	return "http://" + httpLn.Addr().String(), nil
}

// natsListen is where the embedded NATS listens, and why nowhere when it
// does not: PDQ_NATS_LISTEN, or by default NATS's own port on loopback,
// where the tools look with no settings. The default is not taken while
// the gateway wants API keys and NATS wants no credentials: anyone on the
// machine could read and queue requests there, around the keys. When the
// default address is taken (a NATS of its own, another pdq up) a free port
// does instead, with a warning, and pdq up prints it: the default must not
// keep pdq from starting. One that was set and is taken fails the start.
func natsListen(cfg config.Config, log *slog.Logger) (addr, why string) {
	switch {
	case cfg.NATSListenSet && cfg.NATSListen == "":
		return "", "PDQ_NATS_LISTEN is empty"
	case cfg.NATSListenSet:
		return cfg.NATSListen, ""
	case len(cfg.APIKeys) > 0 && cfg.NATS.User == "" && cfg.NATS.Token == "":
		return "", "PDQ_API_KEYS is set and NATS has no credentials: set PDQ_NATS_TOKEN, or PDQ_NATS_LISTEN"
	}
	ln, err := net.Listen("tcp", cfg.NATSListen)
	if err != nil {
		host, _, _ := net.SplitHostPort(cfg.NATSListen)
		log.Warn("NATS's default address is taken: the embedded NATS listens on a free port instead (pdq up prints it); set PDQ_NATS_LISTEN to choose",
			"address", cfg.NATSListen, logging.Err(err))
		return net.JoinHostPort(host, "0"), ""
	}
	ln.Close()
	return cfg.NATSListen, ""
}

// displayAddr is an address a person can paste: 127.0.0.1 for a wildcard
// listener.
func displayAddr(a net.Addr) string {
	tcp, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	if tcp.IP == nil || tcp.IP.IsUnspecified() {
		return fmt.Sprintf("127.0.0.1:%d", tcp.Port)
	}
	return tcp.String()
}

// waitRegistered waits until n workers are in the registry, or timeout,
// and returns how many there are and the models they serve, sorted.
func waitRegistered(ctx context.Context, js jetstream.JetStream, n int, timeout time.Duration) (int, []string) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	kv, err := js.KeyValue(ctx, dispatcher.BucketWorkers)
	if err != nil {
		return 0, nil
	}
	for {
		keys, _ := kv.Keys(ctx)
		if len(keys) >= n || ctx.Err() != nil {
			var models []string
			gctx, stop := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second) // past a wait that timed out
			defer stop()
			for _, k := range keys {
				var w dispatcher.WorkerInfo
				if e, err := kv.Get(gctx, k); err == nil && json.Unmarshal(e.Value(), &w) == nil && w.Model != "" {
					models = append(models, w.Model)
				}
			}
			slices.Sort(models)
			return len(keys), slices.Compact(models)
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}
