// Command pdq is the prefill/decode dispatcher for disaggregated LLM
// serving, and its tools. Each subcommand is a component or tool with a
// Run(ctx) error; main only parses, wires and exits.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"text/tabwriter"

	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// errUsage marks a command line that could not be parsed; main exits 2.
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil:
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		// Stopped by a signal before it was up (still connecting, say):
		// a clean stop.
	case errors.Is(err, errUsage):
		os.Exit(2)
	default:
		fmt.Fprintf(os.Stderr, "pdq: %v\n", err)
		os.Exit(1)
	}
}

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"up", "run everything in one process: NATS, gateway, workers (and simulated engines)", runUp},
		{"gateway", "run the OpenAI-facing gateway, joining PDQ_NATS_URL", runGateway},
		{"prefill", "run a prefill worker for PDQ_ENGINE_URL, joining PDQ_NATS_URL", runPrefill},
		{"decode", "run a decode worker for PDQ_ENGINE_URL, joining PDQ_NATS_URL", runDecode},
		{"sim", "run a simulated vLLM engine with the NIXL handshake (prefill, decode, or both)", runSim},
		{"replay", "run failed requests again from the dead-letter stream (--id ID, --failed [--since DUR])", runReplay},
		{"requests", "show a request's record (ID), or list the failed ones (--failed)", runRequests},
		{"status", "show the live workers and their engines' health, each pool's queues, the dead letters", runStatus},
		{"bench", "benchmark an OpenAI-compatible server as vllm bench serve does (its flags, its result block)", runBench},
		{"pool-name", "print a model's pool and its consumers' names, for deploy files (KEDA)", runPoolName},
		{"probe", "check a URL for a container health check: exit 0 when it answers 2xx", runProbe},
		{"version", "print the version", runVersion},
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		usage(stderr)
		return errUsage
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		usage(stdout)
		return nil
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return c.run(ctx, args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "pdq: unknown command %q\n\n", args[0])
	usage(stderr)
	return errUsage
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "pdq: prefill/decode dispatcher for disaggregated LLM serving")
	fmt.Fprintln(w, "\nUsage: pdq <command> [flags]\n\nCommands:")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range commands() {
		fmt.Fprintf(tw, "  %s\t%s\n", c.name, c.summary)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nRun 'pdq <command> -h' for a command's flags. Services read PDQ_* environment variables (see README).")
}

// newLogger builds the logger from PDQ_LOG_LEVEL and PDQ_LOG_FORMAT.
func newLogger(stderr io.Writer) (*slog.Logger, error) {
	lc, err := config.LoadLog()
	if err != nil {
		return nil, err
	}
	return logging.New(stderr, lc.Level, lc.Format)
}

func runVersion(_ context.Context, _ []string, stdout, _ io.Writer) error {
	_, err := fmt.Fprintf(stdout, "pdq %s\n", version())
	return err
}

// buildInfo is what the build stamped: the module's version, and the
// commit it was built from, when, and whether with uncommitted changes
// (empty without VCS information: go build -buildvcs=false, or outside a
// checkout).
type buildInfo struct {
	version, revision, when string
	modified                bool
}

// stampedRevision is the commit an image was built from, set by the
// linker (-X main.stampedRevision=...): the image is built without .git,
// so the build stamps no VCS information. The one package variable here,
// written only by the linker.
var stampedRevision string

func readBuildInfo() buildInfo {
	b := buildInfo{version: "(devel)", revision: stampedRevision}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	if info.Main.Version != "" {
		b.version = info.Main.Version
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			b.revision = s.Value
		case "vcs.time":
			b.when = s.Value
		case "vcs.modified":
			b.modified = s.Value == "true"
		}
	}
	return b
}

// version is the module's version and the commit it was built from; a
// build without VCS information says so.
func version() string {
	b := readBuildInfo()
	if b.revision == "" {
		return b.version + " (built without VCS information)"
	}
	v := b.version + " (commit " + b.revision[:min(12, len(b.revision))]
	if b.modified {
		v += ", with uncommitted changes"
	}
	if b.when != "" {
		v += ", of " + b.when
	}
	return v + ")"
}
