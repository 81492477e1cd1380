// Command scalecheck measures how pdq's parts grow (issue 28's capacity
// model, docs/scaling.md). It runs a NATS server with JetStream in its
// own process (this one) and pdq's processes on loopback, and prints what
// it measured.
//
//	go run ./tools/scalecheck streams -streams 10000 -gateways 3
//
// holds that many streams open at once through the gateways (decode-only
// requests to slow simulated engines with room for all), and reports each
// gateway's memory and CPU a stream, and the tokens' added latency.
//
//	go run ./tools/scalecheck engines -engines 100 [-nodes 3]
//
// starts that many simulated engines, each with its worker, on one NATS
// server or a cluster of 3 (streams replicated 3 times), and reports
// the NATS traffic the idle fleet makes (registry, heartbeats, queue
// status), and how long the gateway takes to notice a worker gone.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/tools/internal/natsstats"
	"github.com/pdq-dev/pdq/tools/internal/proc"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: scalecheck streams|engines [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "streams":
		err = streams(os.Args[2:])
	case "engines":
		err = engines(os.Args[2:])
	default:
		err = fmt.Errorf("unknown mode %q: streams or engines", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "scalecheck:", err)
		os.Exit(1)
	}
}

// rig is a NATS server in this process, or a cluster of them, and the pdq
// processes started on it.
type rig struct {
	work  string
	bin   string
	srvs  []*server.Server
	env   []string // what every pdq process is given: where NATS is, and its replicas
	procs []*proc.Proc
}

// newRig starts nodes NATS servers with JetStream in this process: one, or
// a cluster whose streams pdq makes with 3 replicas (nodes 3 or more).
func newRig(bin string, nodes int) (*rig, error) {
	work, err := os.MkdirTemp("", "scalecheck-")
	if err != nil {
		return nil, err
	}
	r := &rig{work: work, bin: bin}
	if r.bin == "" {
		r.bin = filepath.Join(work, "pdq")
		if err := proc.Build(".", "./cmd/pdq", r.bin); err != nil {
			return nil, err
		}
	}
	ports := make([]int, nodes)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return nil, err
		}
	}
	var urls []string
	for i := range nodes {
		opts := &server.Options{ServerName: fmt.Sprintf("n%d", i+1), Host: "127.0.0.1", Port: -1, JetStream: true,
			StoreDir: filepath.Join(work, fmt.Sprintf("js%d", i+1)), MaxPayload: 8 << 20, NoSigs: true, MaxConn: 1 << 16}
		if nodes > 1 {
			opts.Cluster = server.ClusterOpts{Name: "scalecheck", Host: "127.0.0.1", Port: ports[i]}
			for j, p := range ports {
				if j != i {
					opts.Routes = append(opts.Routes, &url.URL{Scheme: "nats-route", Host: fmt.Sprintf("127.0.0.1:%d", p)})
				}
			}
		}
		srv, err := server.NewServer(opts)
		if err != nil {
			return nil, err
		}
		go srv.Start()
		if !srv.ReadyForConnections(10 * time.Second) {
			return nil, fmt.Errorf("nats server %d not ready", i+1)
		}
		r.srvs = append(r.srvs, srv)
		urls = append(urls, srv.ClientURL())
	}
	r.env = []string{"PDQ_NATS_URL=" + strings.Join(urls, ",")}
	if nodes >= 3 {
		r.env = append(r.env, "PDQ_NATS_REPLICAS=3")
		// JetStream serves once the cluster has a meta leader.
		for deadline := time.Now().Add(30 * time.Second); !anyLeader(r.srvs); {
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("no JetStream meta leader after 30s")
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return r, nil
}

func anyLeader(srvs []*server.Server) bool {
	for _, s := range srvs {
		if s.JetStreamIsLeader() {
			return true
		}
	}
	return false
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// url is where this tool's own connection goes: the first server.
func (r *rig) url() string { return r.srvs[0].ClientURL() }

// take reads every server's counters, summed: each connection is on one
// server; each node counts the API requests it answered.
func (r *rig) take() (natsstats.Snap, error) {
	all := natsstats.Snap{Conns: map[string]natsstats.Counts{}, Streams: map[string]uint64{}}
	for _, srv := range r.srvs {
		s, err := natsstats.Take(srv)
		if err != nil {
			return all, err
		}
		for name, c := range s.Conns {
			all.Conns[name] = all.Conns[name].Add(c)
		}
		for name, seq := range s.Streams {
			all.Streams[name] = max(all.Streams[name], seq)
		}
		all.API += s.API
	}
	return all, nil
}

func (r *rig) close() {
	for _, p := range r.procs {
		p.Stop()
	}
	for _, srv := range r.srvs {
		srv.Shutdown()
	}
	os.RemoveAll(r.work)
}

// start runs pdq with args and env, and returns the first n log records
// whose msg is ready.
func (r *rig) start(env []string, ready string, n int, args ...string) (*proc.Proc, []map[string]any, error) {
	cmd := exec.Command(r.bin, args...)
	cmd.Env = append(os.Environ(), append(append([]string{"PDQ_LOG_FORMAT=json", "PDQ_LOG_LEVEL=info"}, r.env...), env...)...)
	p, err := proc.Start(cmd)
	if err != nil {
		return nil, nil, err
	}
	r.procs = append(r.procs, p)
	lines, err := p.WaitLines(60*time.Second, n, func(l string) bool { return strings.Contains(l, `"`+ready+`"`) })
	if err != nil {
		return nil, nil, fmt.Errorf("pdq %s: %w\n%s", args[0], err, p.Tail(20))
	}
	recs := make([]map[string]any, len(lines))
	for i, l := range lines {
		json.Unmarshal([]byte(l), &recs[i])
	}
	return p, recs, nil
}

// usage is a process's resident memory and CPU time so far.
type usage struct {
	rss int64 // bytes
	cpu time.Duration
}

func usageOf(pid int) usage {
	var u usage
	if raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for _, l := range strings.Split(string(raw), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				u.rss = kb << 10
			}
		}
	}
	if raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
		// The fields after the command's closing parenthesis; utime and
		// stime are the 14th and 15th of the whole line.
		f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+2:]))
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		u.cpu = time.Duration(ut+st) * time.Second / 100 // USER_HZ
	}
	return u
}

func streams(args []string) error {
	fs := flag.NewFlagSet("streams", flag.ExitOnError)
	n := fs.Int("streams", 10000, "streams held open at once")
	gateways := fs.Int("gateways", 3, "gateways")
	workers := fs.Int("workers", 4, "decode workers, each with an engine of its own (one pdq sim process serves them all)")
	tokens := fs.Int("tokens", 40, "tokens a stream")
	itl := fs.Duration("itl", time.Second, "the engines' time between tokens")
	ramp := fs.Duration("ramp", 20*time.Second, "time over which the streams are opened")
	bin := fs.String("pdq", "", "a pdq binary (default: build ./cmd/pdq)")
	fs.Parse(args)

	r, err := newRig(*bin, 1)
	if err != nil {
		return err
	}
	defer r.close()
	slots := (*n + *workers - 1) / *workers
	_, recs, err := r.start(nil, "simulated engine ready", *workers, "sim", "--engines", strconv.Itoa(*workers), "--addr", "127.0.0.1:0",
		"--kv-port", "0", "--kv-host", "127.0.0.1", "--itl", itl.String(), "--max-num-seqs", strconv.Itoa(slots+slots/4))
	if err != nil {
		return err
	}
	for _, rec := range recs {
		if _, _, err := r.start([]string{"PDQ_ENGINE_URL=http://" + rec["addr"].(string), fmt.Sprintf("PDQ_ENGINE_SLOTS=%d", slots),
			"PDQ_STALL_TIMEOUT=60s"}, "stage worker pulling", 1, "decode"); err != nil {
			return err
		}
	}
	var gws []*proc.Proc
	var urls []string
	for range *gateways {
		p, recs, err := r.start([]string{"PDQ_HTTP_ADDR=127.0.0.1:0", fmt.Sprintf("PDQ_MAX_QUEUE=%d", *n), "PDQ_STALL_TIMEOUT=60s"},
			"gateway listening", 1, "gateway")
		if err != nil {
			return err
		}
		gws = append(gws, p)
		urls = append(urls, "http://"+recs[0]["addr"].(string))
	}
	for _, u := range urls {
		if err := proc.WaitServing(context.Background(), u, 30*time.Second); err != nil {
			return err
		}
	}
	time.Sleep(2 * time.Second)
	idle := make([]usage, len(gws))
	for i, g := range gws {
		idle[i] = usageOf(g.Pid())
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: *n, MaxConnsPerHost: 0}}
	body, _ := json.Marshal(map[string]any{"model": "pdq-sim", "stream": true, "max_tokens": *tokens, "ignore_eos": true,
		"messages": []map[string]string{{"role": "user", "content": "hello"}}})
	type result struct {
		ttft time.Duration
		gaps []time.Duration
		ok   bool
		err  string
	}
	results := make([]result, *n)
	var opened, ended atomic.Int64
	var open sync.WaitGroup // every stream has its first token
	open.Add(*n)
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := range *n {
		time.Sleep(time.Until(t0.Add(time.Duration(i) * *ramp / time.Duration(*n))))
		wg.Go(func() {
			res := &results[i]
			first := false
			defer ended.Add(1)
			defer func() {
				if !first {
					open.Done()
				}
			}()
			req, _ := http.NewRequest(http.MethodPost, urls[i%len(urls)]+"/v1/chat/completions", bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Request-Id", fmt.Sprintf("scale-%d", i))
			start := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				res.err = err.Error()
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				raw, _ := io.ReadAll(resp.Body)
				res.err = fmt.Sprintf("%d %s", resp.StatusCode, raw)
				return
			}
			sc := bufio.NewScanner(resp.Body)
			last := start
			for sc.Scan() {
				line := sc.Text()
				if !strings.HasPrefix(line, "data: ") {
					continue
				}
				now := time.Now()
				if line == "data: [DONE]" {
					res.ok = true
					break
				}
				if !strings.Contains(line, `"content"`) {
					continue
				}
				if !first {
					first = true
					res.ttft = now.Sub(start)
					opened.Add(1)
					open.Done()
				} else {
					res.gaps = append(res.gaps, now.Sub(last))
				}
				last = now
			}
		})
	}
	allOpen := make(chan struct{})
	go func() { open.Wait(); close(allOpen) }()
	select {
	case <-allOpen:
	case <-time.After(*ramp + 60*time.Second):
		errs := map[string]int{}
		for i := range results {
			if e := results[i].err; e != "" {
				errs[e[:min(len(e), 120)]]++
			}
		}
		return fmt.Errorf("%d of %d streams had their first token within %v of the ramp; %d ended; errors: %v",
			opened.Load(), *n, 60*time.Second, ended.Load(), errs)
	}
	openAt := time.Since(t0)
	// Every stream is open: measure the gateways over a window while
	// they all stream.
	window := min(10*time.Second, time.Duration(*tokens-2)**itl-openAt+*ramp)
	if window < 2*time.Second {
		window = 2 * time.Second
	}
	before := make([]usage, len(gws))
	for i, g := range gws {
		before[i] = usageOf(g.Pid())
	}
	time.Sleep(window)
	after := make([]usage, len(gws))
	for i, g := range gws {
		after[i] = usageOf(g.Pid())
	}
	wg.Wait()

	failed, ttfts, gaps := 0, []time.Duration{}, []time.Duration{}
	var firstErr string
	for _, res := range results {
		if !res.ok {
			failed++
			if firstErr == "" {
				firstErr = res.err
			}
			continue
		}
		ttfts = append(ttfts, res.ttft)
		gaps = append(gaps, res.gaps...)
	}
	fmt.Printf("scalecheck streams: %d streams through %d gateways, %d decode workers; %d tokens each, %v apart; opened over %v, all streaming %v after the first; %d failed %s\n",
		*n, *gateways, *workers, *tokens, *itl, *ramp, openAt.Round(time.Millisecond), failed, firstErr)
	per := float64(*n) / float64(len(gws))
	fmt.Printf("\n%-10s %10s %10s %14s %14s %16s\n", "gateway", "RSS idle", "RSS", "RSS a stream", "CPU", "CPU a stream")
	for i := range gws {
		cpu := float64(after[i].cpu-before[i].cpu) / float64(window)
		fmt.Printf("%-10d %8.1fMB %8.1fMB %12.1fKB %13.1f%% %14.4f%%\n", i+1, mb(idle[i].rss), mb(after[i].rss),
			float64(after[i].rss-idle[i].rss)/1024/per, 100*cpu, 100*cpu/per)
	}
	fmt.Printf("\ntime to first token: p50 %v, p99 %v, max %v\n", pct(ttfts, 50), pct(ttfts, 99), pct(ttfts, 100))
	fmt.Printf("between tokens (the engines' %v): p50 %v, p99 %v, max %v\n", *itl, pct(gaps, 50), pct(gaps, 99), pct(gaps, 100))
	return nil
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }

func pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	i := (len(d) - 1) * p / 100
	return d[i].Round(time.Millisecond)
}

// sigkill ends a process at once, as a crash would.
func sigkill(p *proc.Proc) { syscall.Kill(p.Pid(), syscall.SIGKILL) }

func engines(args []string) error {
	fs := flag.NewFlagSet("engines", flag.ExitOnError)
	n := fs.Int("engines", 100, "engines, half prefill and half decode, each with a worker of its own")
	window := fs.Duration("window", 30*time.Second, "how long the idle fleet's traffic is measured")
	nodes := fs.Int("nodes", 1, "NATS servers: 1, or a cluster of 3 with the streams replicated 3 times")
	bin := fs.String("pdq", "", "a pdq binary (default: build ./cmd/pdq)")
	fs.Parse(args)

	r, err := newRig(*bin, *nodes)
	if err != nil {
		return err
	}
	defer r.close()
	started := time.Now()
	var workers []*proc.Proc
	for _, stage := range []string{"prefill", "decode"} {
		count := *n / 2
		if stage == "decode" {
			count = *n - *n/2
		}
		_, recs, err := r.start(nil, "simulated engine ready", count, "sim", "--engines", strconv.Itoa(count), "--addr", "127.0.0.1:0",
			"--kv-port", "0", "--kv-host", "127.0.0.1", "--itl", "1ms", "--prefill-overhead", "1ms")
		if err != nil {
			return err
		}
		for _, rec := range recs {
			p, _, err := r.start([]string{"PDQ_ENGINE_URL=http://" + rec["addr"].(string), "PDQ_ENGINE_SLOTS=8"}, "stage worker pulling", 1, stage)
			if err != nil {
				return err
			}
			workers = append(workers, p)
			if len(workers)%10 == 0 {
				fmt.Fprintf(os.Stderr, "scalecheck: %d workers up after %v\n", len(workers), time.Since(started).Round(time.Millisecond))
			}
		}
	}
	gw, recs, err := r.start([]string{"PDQ_HTTP_ADDR=127.0.0.1:0"}, "gateway listening", 1, "gateway")
	if err != nil {
		return err
	}
	url := "http://" + recs[0]["addr"].(string)
	if err := proc.WaitServing(context.Background(), url, 60*time.Second); err != nil {
		return err
	}
	up := time.Since(started)

	// A registry of this process's own, as the gateway keeps one.
	nc, err := nats.Connect(r.url(), nats.Name("scalecheck"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg, err := registry.WatchWorkers(ctx, js, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	if err := reg.WaitSynced(ctx); err != nil {
		return err
	}
	for deadline := time.Now().Add(30 * time.Second); len(reg.Workers()) < *n; {
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d workers live after 30s", len(reg.Workers()), *n)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// The idle fleet's traffic: what every process sends and receives,
	// and what JetStream does, while no request runs.
	before, err := r.take()
	if err != nil {
		return err
	}
	beforeUse := usageOf(gw.Pid())
	fleet := func() (u usage) {
		for _, w := range workers {
			wu := usageOf(w.Pid())
			u.rss += wu.rss
			u.cpu += wu.cpu
		}
		return u
	}
	beforeFleet, beforeSelf := fleet(), usageOf(os.Getpid())
	// The JetStream API requests by kind, heard on the API's subjects.
	apiKinds := map[string]int{}
	var apiMu sync.Mutex
	sniff, err := nc.Subscribe("$JS.API.>", func(m *nats.Msg) {
		kind := apiKind(m.Subject)
		apiMu.Lock()
		apiKinds[kind]++
		apiMu.Unlock()
	})
	if err != nil {
		return err
	}
	time.Sleep(*window)
	sniff.Unsubscribe()
	after, err := r.take()
	if err != nil {
		return err
	}
	afterUse := usageOf(gw.Pid())
	afterFleet, afterSelf := fleet(), usageOf(os.Getpid())

	// A worker killed: how long until a registry notices.
	victim := workers[len(workers)-1]
	killed := time.Now()
	sigkill(victim)
	for len(reg.Workers()) >= *n {
		if time.Since(killed) > time.Minute {
			return fmt.Errorf("the killed worker still live after a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	noticed := time.Since(killed)

	fmt.Printf("scalecheck engines: %d engines (%d prefill, %d decode), each with its worker, and a gateway, on %d NATS server(s); all up and registered in %v\n",
		*n, *n/2, *n-*n/2, *nodes, up.Round(time.Millisecond))
	secs := window.Seconds()
	fmt.Printf("\nidle, over %v, a second:\n", *window)
	fmt.Printf("%-16s %10s %10s %12s %12s\n", "connections", "msgs in", "msgs out", "bytes in", "bytes out")
	for _, group := range []string{"pdq prefill", "pdq decode", "pdq gateway"} {
		var d natsstats.Counts
		for name, a := range after.Conns {
			if strings.HasPrefix(name, group) {
				d = d.Add(a.Sub(before.Conns[name]))
			}
		}
		fmt.Printf("%-16s %10.1f %10.1f %12.0f %12.0f   (%d connections; server's view: in = sent by them)\n", group,
			float64(d.InMsgs)/secs, float64(d.OutMsgs)/secs, float64(d.InBytes)/secs, float64(d.OutBytes)/secs, d.Conns)
	}
	fmt.Printf("JetStream API requests: %.1f a second; by kind:\n", float64(after.API-before.API)/secs)
	apiMu.Lock()
	kinds := make([]string, 0, len(apiKinds))
	for k := range apiKinds {
		kinds = append(kinds, k)
	}
	slices.SortFunc(kinds, func(a, b string) int { return apiKinds[b] - apiKinds[a] })
	for _, k := range kinds {
		fmt.Printf("  %-40s %8.1f a second\n", k, float64(apiKinds[k])/secs)
	}
	apiMu.Unlock()
	for name, seq := range after.Streams {
		if d := seq - before.Streams[name]; d > 0 {
			fmt.Printf("stored in %s: %.1f a second\n", name, float64(d)/secs)
		}
	}
	fmt.Printf("the gateway: RSS %.1f MB, CPU %.2f%%\n", mb(afterUse.rss), 100*float64(afterUse.cpu-beforeUse.cpu)/float64(*window))
	fmt.Printf("the %d workers: RSS %.0f MB in all, CPU %.1f%% of a core in all; the NATS servers (and this tool): CPU %.1f%%\n",
		len(workers), mb(afterFleet.rss), 100*float64(afterFleet.cpu-beforeFleet.cpu)/float64(*window),
		100*float64(afterSelf.cpu-beforeSelf.cpu)/float64(*window))
	fmt.Printf("\na worker killed (kill -9): a registry took %v to count it gone\n", noticed.Round(time.Millisecond))
	return nil
}

// apiKind is a JetStream API subject without the names in it:
// $JS.API.CONSUMER.INFO.PDQ_DECODE.decode-x is CONSUMER.INFO <stream>.
func apiKind(subject string) string {
	f := strings.Split(strings.TrimPrefix(subject, "$JS.API."), ".")
	switch {
	case len(f) >= 3 && f[0] == "CONSUMER" && f[1] == "MSG" && f[2] == "NEXT":
		return "CONSUMER.MSG.NEXT " + f[3]
	case len(f) >= 3 && (f[0] == "CONSUMER" || f[0] == "STREAM"):
		return f[0] + "." + f[1] + " " + f[2]
	case len(f) >= 2:
		return f[0] + "." + f[1]
	}
	return subject
}
