package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/tools/internal/enginemetrics"
	"github.com/pdq-dev/pdq/tools/internal/proc"
)

// router is one way of serving the load: pdq up, or the plain proxy with
// a policy.
type router struct {
	key, name string
	pdqEnv    []string // pdq up's extra settings; nil for the proxy
	policy    string   // the proxy's -policy
}

func (r router) pdq() bool { return r.policy == "" }

// allRouters are the routers compared. pdq runs with PDQ_FAIR_LIMIT=engines:
// its fair queue holds the work before the engines, the setting for
// engines whose prefill time grows with the tokens they schedule, as the
// seed profile's do.
var allRouters = []router{
	{key: "pdq", name: "pdq", pdqEnv: []string{"PDQ_FAIR_LIMIT=engines"}},
	{key: "pdq-noaff", name: "pdq, affinity off", pdqEnv: []string{"PDQ_FAIR_LIMIT=engines", "PDQ_AFFINITY=false"}},
	{key: "rr", name: "round-robin proxy", policy: "round-robin"},
	{key: "ll", name: "least-loaded proxy", policy: "least-loaded"},
}

// cluster starts the simulated engines and the routers.
type cluster struct {
	pdq, proxy string // binaries
	work       string // scratch directory
	engines    int    // engines a leg
	profile    string
	timeScale  float64
	model      engineModel // the engines' costs
	runs       int         // routers started, for their data directories
}

// engines are a run's simulated engines: one pdq sim process a leg.
type engines struct {
	prefill, decode []string
	procs           []*proc.Proc
}

func (e *engines) stop() {
	for _, p := range e.procs {
		p.Stop()
	}
}

// startEngines starts a prefill and a decode pdq sim, each serving
// c.engines engines of the profile on free loopback ports, fresh (empty
// caches); with priority, under --scheduling-policy priority.
func (c *cluster) startEngines(ctx context.Context, priority bool) (*engines, error) {
	e := &engines{}
	for _, leg := range []*[]string{&e.prefill, &e.decode} {
		args := []string{"sim", "--profile", c.profile, "--time-scale", strconv.FormatFloat(c.timeScale, 'g', -1, 64),
			"--engines", strconv.Itoa(c.engines), "--addr", "127.0.0.1:0", "--kv-port", "0", "--kv-host", "127.0.0.1",
			"--enable-prompt-tokens-details"}
		if priority {
			args = append(args, "--scheduling-policy", "priority")
		}
		cmd := exec.CommandContext(ctx, c.pdq, args...)
		cmd.Env = append(os.Environ(), "PDQ_LOG_FORMAT=json", "PDQ_LOG_LEVEL=info")
		p, err := proc.Start(cmd)
		if err != nil {
			e.stop()
			return nil, err
		}
		e.procs = append(e.procs, p)
		lines, err := p.WaitLines(10*time.Second, c.engines, func(l string) bool {
			return strings.Contains(l, `"simulated engine ready"`)
		})
		if err != nil {
			e.stop()
			return nil, err
		}
		for _, l := range lines {
			var ready struct {
				Msg, Addr string
			}
			if err := json.Unmarshal([]byte(l), &ready); err != nil || ready.Addr == "" {
				e.stop()
				return nil, fmt.Errorf("pdq sim: cannot read its ready line %q", l)
			}
			*leg = append(*leg, "http://"+ready.Addr)
		}
	}
	return e, nil
}

// pids are the engines' processes.
func (e *engines) pids() []int {
	var out []int
	for _, p := range e.procs {
		out = append(out, p.Pid())
	}
	return out
}

// startRouter starts r in front of the engines and returns its URL, once
// it serves a request through both legs, its process, what stops it, and
// a note on how it runs (pdq's settings that this pdq does not know).
func (c *cluster) startRouter(ctx context.Context, r router, e *engines) (string, *proc.Proc, func(), string, error) {
	var cmd *exec.Cmd
	var ready func(string) bool
	var url func(string) string
	data := ""
	if r.pdq() {
		c.runs++
		data = fmt.Sprintf("%s/data-%d", c.work, c.runs)
		cmd = exec.CommandContext(ctx, c.pdq, "up")
		cmd.Env = append(os.Environ(), "PDQ_HTTP_ADDR=127.0.0.1:0", "PDQ_NATS_LISTEN=", "PDQ_DATA_DIR="+data,
			"PDQ_PREFILL_ENGINES="+strings.Join(e.prefill, ","), "PDQ_DECODE_ENGINES="+strings.Join(e.decode, ","),
			"PDQ_LOG_FORMAT=json", "PDQ_LOG_LEVEL=warn")
		cmd.Env = append(cmd.Env, r.pdqEnv...)
		const up = "pdq is up: OpenAI API at "
		ready = func(l string) bool { return strings.HasPrefix(l, up) }
		url = func(l string) string { return strings.TrimSuffix(strings.TrimPrefix(l, up), "/v1") }
	} else {
		cmd = exec.CommandContext(ctx, c.proxy, "-addr", "127.0.0.1:0", "-policy", r.policy,
			"-prefill", strings.Join(e.prefill, ","), "-decode", strings.Join(e.decode, ","))
		const listening = "pdproxy listening on "
		ready = func(l string) bool { return strings.HasPrefix(l, listening) }
		url = func(l string) string { return "http://" + strings.Fields(strings.TrimPrefix(l, listening))[0] }
	}
	p, err := proc.Start(cmd)
	if err != nil {
		return "", nil, nil, "", err
	}
	stop := func() {
		p.Stop()
		if data != "" {
			os.RemoveAll(data)
		}
	}
	lines, err := p.WaitLines(30*time.Second, 1, ready)
	if err != nil {
		stop()
		return "", nil, nil, "", err
	}
	u := url(lines[0])
	if err := proc.WaitServing(ctx, u, 30*time.Second); err != nil {
		stop()
		return "", nil, nil, "", fmt.Errorf("%s: %w\n%s", r.name, err, p.Tail(20))
	}
	return u, p, stop, unknownSettings(p.Lines(), r.pdqEnv), nil
}

// unknownSettings names the settings of env that pdq's log calls unknown
// (it warns of a PDQ_ variable it does not read), as a note for the
// tables.
func unknownSettings(lines, env []string) string {
	var unknown []string
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		for _, l := range lines {
			if strings.Contains(l, "unknown PDQ_ variable") && strings.Contains(l, `"`+name+`"`) {
				unknown = append(unknown, name)
				break
			}
		}
	}
	if len(unknown) == 0 {
		return ""
	}
	return strings.Join(unknown, ", ") + " unknown to this pdq (ignored): the same as pdq"
}

// prefixCounters sums the prefix-cache counters of the engines at urls:
// tokens looked up, and tokens found; and the seconds they spent in steps.
func prefixCounters(ctx context.Context, urls []string) (queries, hits, busy float64, err error) {
	client := &http.Client{Timeout: 5 * time.Second}
	for _, u := range urls {
		m, err := enginemetrics.Fetch(ctx, client, u)
		if err != nil {
			return 0, 0, 0, err
		}
		queries += m[enginemetrics.PrefixQueries]
		hits += m[enginemetrics.PrefixHits]
		busy += m[enginemetrics.Busy]
	}
	return queries, hits, busy, nil
}
