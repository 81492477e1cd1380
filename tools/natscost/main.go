// Command natscost measures what one request costs NATS, by component:
// the messages and bytes each of pdq's processes sends and receives, the
// JetStream API requests they make, and the messages stored in each
// stream. It runs a NATS server in its own process (this one, with
// JetStream), and pdq's gateway, a prefill worker and a decode worker as
// processes of their own, each on its own connection, in front of two
// pdq sim engines; sends a warm-up, then -n requests, and reads the
// server's counters before and after (issue 28's capacity model,
// docs/scaling.md).
//
//	go run ./tools/natscost -n 400 -c 16 -tokens 32
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/pdq-dev/pdq/tools/internal/natsstats"
	"github.com/pdq-dev/pdq/tools/internal/proc"
)

func main() {
	n := flag.Int("n", 400, "requests measured")
	c := flag.Int("c", 16, "requests at once")
	tokens := flag.Int("tokens", 32, "output tokens a request (streamed)")
	words := flag.Int("words", 400, "words of the prompt")
	pdq := flag.String("pdq", "", "a pdq binary (default: build ./cmd/pdq)")
	flag.Parse()
	if err := run(*n, *c, *tokens, *words, *pdq); err != nil {
		fmt.Fprintln(os.Stderr, "natscost:", err)
		os.Exit(1)
	}
}

func run(n, conc, tokens, words int, bin string) error {
	work, err := os.MkdirTemp("", "natscost-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if bin == "" {
		bin = filepath.Join(work, "pdq")
		if err := proc.Build(".", "./cmd/pdq", bin); err != nil {
			return err
		}
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: filepath.Join(work, "js"),
		MaxPayload: 8 << 20, NoSigs: true})
	if err != nil {
		return err
	}
	go srv.Start()
	defer srv.Shutdown()
	if !srv.ReadyForConnections(10 * time.Second) {
		return fmt.Errorf("nats server not ready")
	}
	natsURL := srv.ClientURL()

	var procs []*proc.Proc
	defer func() {
		for _, p := range procs {
			p.Stop()
		}
	}()
	start := func(env []string, ready string, args ...string) (map[string]any, error) {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), append([]string{"PDQ_LOG_FORMAT=json", "PDQ_LOG_LEVEL=info", "PDQ_NATS_URL=" + natsURL}, env...)...)
		p, err := proc.Start(cmd)
		if err != nil {
			return nil, err
		}
		procs = append(procs, p)
		lines, err := p.WaitLines(20*time.Second, 1, func(l string) bool { return strings.Contains(l, `"`+ready+`"`) })
		if err != nil {
			return nil, fmt.Errorf("pdq %s: %w\n%s", args[0], err, p.Tail(20))
		}
		var rec map[string]any
		json.Unmarshal([]byte(lines[0]), &rec)
		return rec, nil
	}
	engine := func() (string, error) {
		rec, err := start(nil, "simulated engine ready", "sim", "--addr", "127.0.0.1:0", "--kv-port", "0", "--kv-host", "127.0.0.1",
			"--prefill-overhead", "5ms", "--itl", "5ms")
		if err != nil {
			return "", err
		}
		return "http://" + rec["addr"].(string), nil
	}
	pe, err := engine()
	if err != nil {
		return err
	}
	de, err := engine()
	if err != nil {
		return err
	}
	gw, err := start([]string{"PDQ_HTTP_ADDR=127.0.0.1:0"}, "gateway listening", "gateway")
	if err != nil {
		return err
	}
	if _, err := start([]string{"PDQ_ENGINE_URL=" + pe}, "stage worker pulling", "prefill"); err != nil {
		return err
	}
	if _, err := start([]string{"PDQ_ENGINE_URL=" + de}, "stage worker pulling", "decode"); err != nil {
		return err
	}
	url := "http://" + gw["addr"].(string)
	ctx := context.Background()
	if err := proc.WaitServing(ctx, url, 30*time.Second); err != nil {
		return err
	}
	prompt := strings.TrimSpace(strings.Repeat("the prefill engine hands its cache to the decode engine ", words/10))
	if failed := load(url, "warm", 20, 4, prompt, tokens); failed > 0 {
		return fmt.Errorf("%d of the 20 warm-up requests failed", failed)
	}
	time.Sleep(2 * time.Second) // the warm-up's records and releases settle
	before, err := natsstats.Take(srv)
	if err != nil {
		return err
	}
	t0 := time.Now()
	failed := load(url, "cost", n, conc, prompt, tokens)
	took := time.Since(t0)
	time.Sleep(2 * time.Second)
	after, err := natsstats.Take(srv)
	if err != nil {
		return err
	}
	report(os.Stdout, before, after, n, failed, conc, tokens, words, took)
	return nil
}

// load sends n streamed chat requests, conc at once, and returns how
// many did not end whole.
func load(url, prefix string, n, conc int, prompt string, tokens int) int {
	var failed atomic.Int64
	var next atomic.Int64
	var wg sync.WaitGroup
	body := func() []byte {
		b, _ := json.Marshal(map[string]any{"model": "pdq-sim", "stream": true, "max_tokens": tokens, "ignore_eos": true,
			"messages": []map[string]string{{"role": "user", "content": prompt}}})
		return b
	}()
	for range conc {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < int64(n); i = next.Add(1) - 1 {
				req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Request-Id", fmt.Sprintf("%s-%d", prefix, i))
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					failed.Add(1)
					continue
				}
				raw, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || !bytes.HasSuffix(raw, []byte("data: [DONE]\n\n")) {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	return int(failed.Load())
}

func report(w io.Writer, before, after natsstats.Snap, n, failed, conc, tokens, words int, took time.Duration) {
	fmt.Fprintf(w, "natscost: %d streamed chat requests (%d at once, a %d-word prompt, %d output tokens), %d failed, in %v (%.0f req/s)\n\n",
		n, conc, words, tokens, failed, took.Round(time.Millisecond), float64(n)/took.Seconds())
	per := func(v int64) string { return fmt.Sprintf("%.1f", float64(v)/float64(n)) }
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "connection\tmsgs sent\tmsgs received\tbytes sent\tbytes received\t")
	names := make([]string, 0, len(after.Conns))
	for name := range after.Conns {
		names = append(names, name)
	}
	sort.Strings(names)
	var total natsstats.Counts
	for _, name := range names {
		d := after.Conns[name].Sub(before.Conns[name])
		total = total.Add(d)
		// The server's in is the client's sent, its out the client's received.
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t\n", name, per(d.InMsgs), per(d.OutMsgs), per(d.InBytes), per(d.OutBytes))
	}
	fmt.Fprintf(tw, "all\t%s\t%s\t%s\t%s\t\n", per(total.InMsgs), per(total.OutMsgs), per(total.InBytes), per(total.OutBytes))
	tw.Flush()
	fmt.Fprintf(w, "\nper request: %.1f JetStream API requests\n", float64(after.API-before.API)/float64(n))
	streams := make([]string, 0, len(after.Streams))
	for name := range after.Streams {
		streams = append(streams, name)
	}
	sort.Strings(streams)
	fmt.Fprintln(w, "messages stored per request, by stream:")
	for _, name := range streams {
		if d := after.Streams[name] - before.Streams[name]; d > 0 {
			fmt.Fprintf(w, "  %-28s %.2f\n", name, float64(d)/float64(n))
		}
	}
}
