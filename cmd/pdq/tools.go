package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/admin"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/pkg/config"
)

// toolFlags are the flags every one-shot tool shares.
type toolFlags struct {
	natsURL string
}

func (f *toolFlags) register(fs *flag.FlagSet) {
	// The default is read at connect, not shown in -h: PDQ_NATS_URL may
	// carry a password.
	fs.StringVar(&f.natsURL, "nats", "", "the NATS server pdq uses (default: $PDQ_NATS_URL, else "+nats.DefaultURL+")")
}

// url is the NATS server to join: --nats, else PDQ_NATS_URL, else the
// default.
func (f *toolFlags) url() string {
	switch {
	case f.natsURL != "":
		return f.natsURL
	case os.Getenv("PDQ_NATS_URL") != "":
		return os.Getenv("PDQ_NATS_URL")
	}
	return nats.DefaultURL
}

// connectTool joins NATS once, with the PDQ_NATS_* credentials, without
// retrying: a tool reports a NATS it cannot reach and exits.
func (f *toolFlags) connect(ctx context.Context, name string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := config.LoadNATS()
	if err != nil {
		return nil, nil, err
	}
	auth, err := natsAuth(nc)
	if err != nil {
		return nil, nil, err
	}
	conn, err := nats.Connect(f.url(), append([]nats.Option{nats.Name("pdq " + name), nats.Timeout(5 * time.Second)}, auth...)...)
	if err != nil {
		if _, hint := connectError(err); hint != "" {
			err = fmt.Errorf("%w (%s)", err, hint)
		} else if errors.Is(err, nats.ErrNoServers) {
			// The first thing a new user meets after make run.
			err = fmt.Errorf("%w (is pdq up running? its NATS is at "+nats.DefaultURL+" unless PDQ_NATS_LISTEN moved it, or its port was taken: its start says where; "+
				"otherwise set --nats or PDQ_NATS_URL to the NATS pdq uses)", err)
		}
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w", redactURLs(f.url()), err)
	}
	js, err := jetstream.New(conn)
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return conn, js, nil
}

// parseTool parses a tool's flags, before and after its arguments
// (`pdq requests ID --json` as `pdq requests --json ID`); it returns
// flag.ErrHelp for -h and errUsage for a bad line.
func parseTool(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	fs.SetOutput(stderr)
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return flag.ErrHelp
			}
			return errUsage
		}
		if fs.NArg() == 0 {
			break
		}
		if used := len(args) - fs.NArg(); used > 0 && args[used-1] == "--" {
			positional = append(positional, fs.Args()...) // after --, all are arguments
			break
		}
		positional, args = append(positional, fs.Arg(0)), fs.Args()[1:]
	}
	// What Args returns: the arguments without the flags.
	return fs.Parse(append([]string{"--"}, positional...))
}

func runReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq replay", flag.ContinueOnError)
	var tf toolFlags
	tf.register(fs)
	id := fs.String("id", "", "replay the dead letter of this request id")
	failed := fs.Bool("failed", false, "replay every dead letter")
	since := fs.Duration("since", 0, "with --failed: only dead letters stored this recently (e.g. 1h)")
	timeout := fs.Duration("timeout", 10*time.Minute, "the replayed requests' deadline")
	wait := fs.Bool("wait", false, "wait for the replayed requests to end and print how they ended")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: pdq replay (--id ID | --failed [--since DUR]) [--wait]\n\n"+
			"Runs failed requests again from the dead-letter stream PDQ_DLQ, each as its next generation with a\n"+
			"fresh deadline. Their answers are kept in the request records: see pdq requests ID. A request that\n"+
			"has succeeded since, or is in flight, is not replayed. Running replay twice runs each request once.\n\n")
		fs.PrintDefaults()
	}
	if err := parseTool(fs, args, stderr); err != nil {
		return helpIsNoError(err)
	}
	if (*id == "") == !*failed || fs.NArg() > 0 || (*since != 0 && !*failed) || *timeout <= 0 {
		fs.Usage()
		return errUsage
	}
	nc, js, err := tf.connect(ctx, "replay")
	if err != nil {
		return err
	}
	defer nc.Close()
	rp, err := admin.NewReplayer(ctx, js, *timeout)
	if err != nil {
		return err
	}
	var letters []admin.DeadLetter
	if *id != "" {
		dl, err := rp.Find(ctx, *id)
		if err != nil {
			return err
		}
		letters = append(letters, dl)
	} else {
		from := time.Time{}
		if *since > 0 {
			from = time.Now().Add(-*since)
		}
		if letters, err = rp.DeadLetters(ctx, from); err != nil {
			return err
		}
	}
	var replayed []string
	refused := 0
	for i, dl := range letters {
		gen, err := rp.Replay(ctx, dl)
		switch {
		case errors.Is(err, admin.ErrSucceeded), errors.Is(err, admin.ErrLive):
			refused++
			fmt.Fprintf(stdout, "[%d/%d] %s: not replayed: %v\n", i+1, len(letters), dl.ID, err)
		case err != nil:
			return fmt.Errorf("replay %s (%d of %d; those before it are replaying): %w", dl.ID, i+1, len(letters), err)
		default:
			replayed = append(replayed, dl.ID)
			fmt.Fprintf(stdout, "[%d/%d] %s: replaying as generation %d (failed in %s: %s)\n", i+1, len(letters), dl.ID, gen, dl.Stage, dl.Reason)
		}
	}
	fmt.Fprintf(stdout, "%d replayed, %d not replayed\n", len(replayed), refused)
	if !*wait || len(replayed) == 0 {
		return nil
	}
	// Each as it ends, and every 10 s without an end how many still run.
	failedAgain, ended := 0, 0
	wctx, cancel := context.WithTimeout(ctx, *timeout+30*time.Second) // past every replay's deadline
	defer cancel()
	err = rp.WaitAll(wctx, replayed, 10*time.Second, func(r *dispatcher.Record) {
		ended++
		line := fmt.Sprintf("[%d/%d ended] %s: %s", ended, len(replayed), recordName(r), r.State)
		if r.Error != nil {
			line += fmt.Sprintf(" (%d %s)", r.Error.Status, r.Error.Message)
		}
		if r.State != dispatcher.StateDone {
			failedAgain++
		}
		fmt.Fprintln(stdout, line)
	}, func(left int) {
		fmt.Fprintf(stdout, "[%d/%d ended] %d still running\n", ended, len(replayed), left)
	})
	if err != nil {
		return fmt.Errorf("wait for the replayed requests (%d of %d ended): %w", ended, len(replayed), err)
	}
	if failedAgain > 0 {
		return fmt.Errorf("%d of %d replayed requests did not succeed", failedAgain, len(replayed))
	}
	return nil
}

func runRequests(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq requests", flag.ContinueOnError)
	var tf toolFlags
	tf.register(fs)
	failed := fs.Bool("failed", false, "list the requests that failed, were cancelled or expired")
	asJSON := fs.Bool("json", false, "print JSON")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: pdq requests ID | pdq requests --failed [--json]\n\n"+
			"Shows a request's record (state, generation, stages, error, a replay's result), or lists the\n"+
			"requests of the last 24 hours that did not succeed.\n\n")
		fs.PrintDefaults()
	}
	if err := parseTool(fs, args, stderr); err != nil {
		return helpIsNoError(err)
	}
	if (fs.NArg() == 1) == *failed || fs.NArg() > 1 {
		fs.Usage()
		return errUsage
	}
	nc, js, err := tf.connect(ctx, "requests")
	if err != nil {
		return err
	}
	defer nc.Close()
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		return err
	}
	if !*failed {
		// The client's X-Request-Id, or the key it runs under (as the
		// list shows it).
		r, err := dispatcher.ReadRecord(ctx, js, records, fs.Arg(0))
		if err != nil {
			return fmt.Errorf("request %s: %w", fs.Arg(0), err)
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	list := []*dispatcher.Record{} // none is [] in JSON, not null
	if err := records.List(ctx, func(r *dispatcher.Record) bool {
		if r.State.Ended() && r.State != dispatcher.StateDone {
			list = append(list, r)
		}
		return true
	}); err != nil {
		return err
	}
	if *asJSON {
		return json.NewEncoder(stdout).Encode(list)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tGEN\tSTATUS\tUPDATED\tERROR")
	for _, r := range list {
		status, msg := 0, ""
		if r.Error != nil {
			status, msg = r.Error.Status, r.Error.Message
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\n", recordName(r), r.State, r.Generation, status, r.Updated.Format(time.RFC3339), truncateLine(msg, 80))
	}
	return tw.Flush()
}

// recordName is how the tools show a request: its key, and the client's
// X-Request-Id when that is not the key itself (see dispatcher.RequestKey).
func recordName(r *dispatcher.Record) string {
	if r.ClientID == "" || r.ClientID == r.ID {
		return r.ID
	}
	return fmt.Sprintf("%s (X-Request-Id %q)", r.ID, r.ClientID)
}

// isTerminal reports whether w is a terminal: screen codes are for a
// terminal, not for a file or a pipe.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func truncateLine(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}

// status is what `pdq status` prints: the live workers with their engines'
// health, each pool's queues, and the dead letters.
type status struct {
	Workers     []dispatcher.WorkerInfo `json:"workers"`
	Queues      []admin.QueueStatus     `json:"queues"`
	DeadLetters uint64                  `json:"dead_letters"`
	// Stores is whether each of pdq's file streams stores writes.
	Stores []admin.StoreHealth `json:"stores"`
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq status", flag.ContinueOnError)
	var tf toolFlags
	tf.register(fs)
	asJSON := fs.Bool("json", false, "print JSON")
	watch := fs.Duration("watch", 0, "show it again every this long (e.g. 2s), until interrupted")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: pdq status [--json] [--watch 2s]\n\n"+
			"Shows the live workers (role, pool, engine, slots, the engine's seats, jobs running, its breaker), each\n"+
			"pool's prefill and decode queues, and the dead letters kept for replay.\n\n")
		fs.PrintDefaults()
	}
	if err := parseTool(fs, args, stderr); err != nil {
		return helpIsNoError(err)
	}
	if fs.NArg() > 0 || *watch < 0 {
		fs.Usage()
		return errUsage
	}
	nc, js, err := tf.connect(ctx, "status")
	if err != nil {
		return err
	}
	defer nc.Close()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reg, err := registry.WatchWorkers(wctx, js, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	// Every worker answers the registry's question within a round trip;
	// those listed in the bucket are waited for a little longer.
	sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
	defer scancel()
	_ = reg.WaitSynced(sctx) // a worker that never answers is not live
	for {
		if *watch > 0 && !*asJSON {
			if isTerminal(stdout) {
				fmt.Fprint(stdout, "\x1b[H\x1b[2J") // the screen anew
			}
			fmt.Fprintf(stdout, "%s\n\n", time.Now().Format(time.DateTime))
		}
		if err := printStatus(ctx, js, reg, stdout, *asJSON); err != nil {
			return err
		}
		if *watch == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(*watch):
		}
	}
}

// printStatus prints the status once, as a table or as JSON.
func printStatus(ctx context.Context, js jetstream.JetStream, reg *registry.Registry, stdout io.Writer, asJSON bool) error {
	var err error
	s := status{Workers: reg.Workers()}
	pools := map[string]bool{}
	for _, w := range s.Workers {
		if !pools[w.Pool] {
			pools[w.Pool] = true
			q, err := admin.Queues(ctx, js, w.Pool)
			if err != nil {
				return err
			}
			s.Queues = append(s.Queues, q...)
		}
	}
	if s.DeadLetters, err = admin.DeadLetters(ctx, js); err != nil {
		return err
	}
	s.Stores = admin.CheckStores(ctx, js)
	if asJSON {
		return json.NewEncoder(stdout).Encode(s)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKER\tROLE\tPOOL\tENGINE\tSLOTS\tSEATS\tRUNNING\tBREAKER\tAVG JOB MS")
	for _, w := range s.Workers {
		breaker := w.Breaker
		if breaker == "" {
			breaker = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s\t%.0f\n", w.ID, w.Role, w.Pool, w.Engine, w.Slots, w.Capacity(), w.InFlight, breaker, w.AvgJobMs)
	}
	fmt.Fprintln(tw, "\nPOOL\tSTAGE\tWAITING\tOLDEST\tRUNNING\tIDLE PULLS\tREDELIVERED")
	for _, q := range s.Queues {
		oldest := "-"
		if q.Waiting > 0 {
			oldest = (time.Duration(q.OldestSeconds * float64(time.Second))).Round(100 * time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%d\t%d\n", q.Pool, q.Stage, q.Waiting, oldest, q.Running, q.IdlePulls, q.Redelivered)
	}
	fmt.Fprintf(tw, "\nDEAD LETTERS\t%d\n", s.DeadLetters)
	fmt.Fprintln(tw, "\nSTREAM\tSTORES")
	for _, h := range s.Stores {
		stores := "yes"
		if h.Stores && h.Error != "" {
			stores = "unknown: " + h.Error // the server could not be asked
		}
		if !h.Stores {
			stores = "NO: " + h.Error + " (its disk may be full; a gateway rebuilds it once the store can write)"
		}
		fmt.Fprintf(tw, "%s\t%s\n", h.Stream, stores)
	}
	return tw.Flush()
}

// runProbe is a health check for images without a shell: it asks a URL
// (a gateway's /ready, an engine's /health) and fails unless it answers
// 2xx.
func runProbe(ctx context.Context, args []string, _, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq probe", flag.ContinueOnError)
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for the answer")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: pdq probe [--timeout 2s] URL\n\n"+
			"Exits 0 when URL answers 2xx: a container health check for an image without a shell, e.g.\n"+
			"pdq probe http://127.0.0.1:8000/ready.\n\n")
		fs.PrintDefaults()
	}
	if err := parseTool(fs, args, stderr); err != nil {
		return helpIsNoError(err)
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return errUsage
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fs.Arg(0), nil)
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("probe: %s answered %d", fs.Arg(0), resp.StatusCode)
	}
	return nil
}

// runPoolName prints the pool a model's jobs go to, and its consumers'
// names: deploy files (KEDA's scalers) name a consumer, and a consumer that
// does not exist makes KEDA scale to its maximum, so the name is computed
// here rather than by hand.
func runPoolName(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq pool-name", flag.ContinueOnError)
	consumer := fs.String("consumer", "", "print the consumer name of this stage (prefill or decode) instead of the pool")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: pdq pool-name [--consumer prefill|decode] MODEL\n\n"+
			"Prints the pool's subject token for a served model name, or with --consumer the name of\n"+
			"that stage's JetStream consumer (what KEDA's nats-jetstream scaler reads).\n\n")
		fs.PrintDefaults()
	}
	if err := parseTool(fs, args, stderr); err != nil {
		return helpIsNoError(err)
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return errUsage
	}
	pool := dispatcher.PoolName(fs.Arg(0))
	switch *consumer {
	case "":
		_, err := fmt.Fprintln(stdout, pool)
		return err
	case string(dispatcher.StagePrefill), string(dispatcher.StageDecode):
		_, err := fmt.Fprintln(stdout, dispatcher.ConsumerName(dispatcher.Stage(*consumer), pool))
		return err
	default:
		fmt.Fprintf(stderr, "pdq pool-name: --consumer is prefill or decode, not %q\n", *consumer)
		return errUsage
	}
}
