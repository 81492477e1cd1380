package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/tests/netlab"
)

// pdqBinary is the pdq command built once for the tests that run it as a
// separate process.
var pdqBinary string

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	dir, err := os.MkdirTemp("", "pdq-tests-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	pdqBinary = filepath.Join(dir, "pdq")
	build := exec.Command("go", "build", "-buildvcs=auto", "-o", pdqBinary, "github.com/pdq-dev/pdq/cmd/pdq")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build pdq:", err)
		return 1
	}
	return m.Run()
}

// process is a running `pdq` command that logs JSON to stderr.
type process struct {
	name   string
	cmd    *exec.Cmd
	mu     sync.Mutex
	logs   bytes.Buffer
	recs   []map[string]any // the JSON log records so far
	grew   chan struct{}    // closed and replaced whenever a record arrives
	exited chan struct{}    // closed once the process has exited
	err    error            // how it exited, set before exited closes
	stdout bytes.Buffer
}

func (p *process) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

// startPDQ runs pdq with args and extra environment, logging JSON at debug
// level. The process gets SIGTERM when the test ends and must exit cleanly.
func startPDQ(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	return startPDQCmd(t, exec.Command(pdqBinary, args...), env, args)
}

// startPDQOn is startPDQ on one of a lab's hosts.
func startPDQOn(t *testing.T, h *netlab.Host, env []string, args ...string) *process {
	t.Helper()
	return startPDQCmd(t, h.Command(context.Background(), pdqBinary, args...), env, args)
}

// startPDQCmd starts cmd, pdq with args, as startPDQ does.
func startPDQCmd(t *testing.T, cmd *exec.Cmd, env []string, args []string) *process {
	t.Helper()
	cmd.Env = processEnv(env)
	dieWithTests(cmd)
	p := &process{name: strings.Join(args, " "), cmd: cmd, grew: make(chan struct{}), exited: make(chan struct{})}
	cmd.Stdout = &lockedWriter{mu: &p.mu, w: &p.stdout}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			var rec map[string]any
			json.Unmarshal([]byte(line), &rec)
			p.mu.Lock()
			p.logs.WriteString(line + "\n")
			if rec != nil {
				p.recs = append(p.recs, rec)
			}
			close(p.grew)
			p.grew = make(chan struct{})
			p.mu.Unlock()
		}
		io.Copy(io.Discard, stderr)
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() { p.stop(t) })
	return p
}

// processEnv is the environment of a pdq process that a test starts: the
// test's own, JSON logs at debug level, pdq up's NATS on a free port (not
// its default 4222, which tests running at once would share), then env.
// "-NAME" in env removes NAME.
func processEnv(env []string) []string {
	out := append(os.Environ(), "PDQ_LOG_FORMAT=json", "PDQ_LOG_LEVEL=debug", "PDQ_NATS_LISTEN=127.0.0.1:0")
	for _, e := range env {
		name, unset := strings.CutPrefix(e, "-")
		if !unset {
			out = append(out, e)
			continue
		}
		out = slices.DeleteFunc(out, func(kv string) bool { return strings.HasPrefix(kv, name+"=") })
	}
	return out
}

// waitLog waits for the first log record with message msg and returns it.
func (p *process) waitLog(t *testing.T, msg string) map[string]any {
	t.Helper()
	deadline := time.After(20 * time.Second)
	seen := 0
	for {
		p.mu.Lock()
		recs, grew := p.recs, p.grew
		p.mu.Unlock()
		for _, r := range recs[seen:] {
			if r["msg"] == msg {
				return r
			}
		}
		seen = len(recs)
		select {
		case <-grew:
		case <-p.exited:
			t.Fatalf("pdq %s exited (%v) before logging %q:\n%s", p.name, p.err, msg, p.output())
		case <-deadline:
			t.Fatalf("pdq %s did not log %q within 20s:\n%s", p.name, msg, p.output())
		}
	}
}

// waitStdout waits until the process has printed want, and returns all it
// printed.
func (p *process) waitStdout(t *testing.T, want string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		p.mu.Lock()
		out := p.stdout.String()
		p.mu.Unlock()
		if strings.Contains(out, want) {
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("pdq %s did not print %q within 20s; stdout %q", p.name, want, out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// lockedWriter serializes writes with the process's lock.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// startSimProcess runs `pdq sim` with free loopback ports and learns them
// from its ready line.
func startSimProcess(t *testing.T, args ...string) (*process, *simtest.Engine) {
	t.Helper()
	args = append([]string{"sim", "--addr", "127.0.0.1:0", "--kv-host", "127.0.0.1", "--kv-port", "0",
		"--prefill-overhead", "1ms", "--itl", "0s"}, args...)
	if p := os.Getenv("PDQ_SIM_PROFILE"); p != "" {
		// The suites on batched engines (vLLM's scheduler model), their
		// costs scaled down a hundredfold, as simtest.FastConfig does.
		args = append(args, "--profile", p, "--time-scale", "0.01")
	}
	p := startPDQ(t, nil, args...)
	rec := p.waitLog(t, "simulated engine ready")
	return p, &simtest.Engine{URL: "http://" + rec["addr"].(string)}
}

// stop sends SIGTERM and waits for a clean exit.
func (p *process) stop(t *testing.T) {
	t.Helper()
	select {
	case <-p.exited:
		return
	default:
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		if p.err != nil {
			t.Errorf("pdq %s exited with %v after SIGTERM:\n%s", p.name, p.err, p.output())
		}
	case <-time.After(15 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
		t.Errorf("pdq %s ignored SIGTERM for 15s:\n%s", p.name, p.output())
	}
}

// TestSimProcesses replays the seed incident across real `pdq sim`
// processes: the decode process stays dead until it is restarted, and the
// restarted one serves a correct handshake.
func TestSimProcesses(t *testing.T) {
	_, p := startSimProcess(t, "--nixl-protocol", "v1")
	dproc, d := startSimProcess(t, "--nixl-protocol", "v1")
	b := completionBody(model, "Disaggregation splits prefill from decode.", body{"max_tokens": 5, "ignore_eos": true})

	params := runPrefill(t, p, openai.Completions, "proc-A", b)
	post(t, d.URL+openai.Completions.Path(), "proc-B", decodeBody(b, params)).wantStatus(t, 500)
	get(t, d.URL+"/health").wantStatus(t, 503)
	if s := d.Stats(t); !s.EngineDead {
		t.Fatalf("decode stats = %+v; want engine_dead", s)
	}
	if !strings.Contains(dproc.output(), "EngineCore died") {
		t.Errorf("the decode process did not log its death:\n%s", dproc.output())
	}

	dproc.stop(t)
	_, d = startSimProcess(t, "--nixl-protocol", "v1")
	get(t, d.URL+"/health").wantStatus(t, 200)
	params = runPrefill(t, p, openai.Completions, "proc-C", b)
	b["stream"] = true
	b["stream_options"] = map[string]any{"include_usage": true}
	res := parseStream(t, postStream(t, d.URL+openai.Completions.Path(), "proc-C", decodeBody(b, params)), openai.Completions, true)
	if res.usage.CompletionTokens != 5 || res.id != "cmpl-proc-C" {
		t.Errorf("stream result = %+v", res)
	}
	if s := d.Stats(t); s.KVReads != 1 || s.Decodes != 1 || s.EngineDead {
		t.Errorf("decode stats = %+v", s)
	}
	// The first prefill's blocks were never read and stay held (until the
	// lease); the second's were read and freed.
	if s := p.Stats(t); s.Prefills != 2 || s.KVServed != 1 || s.BlocksHeld != 1 {
		t.Errorf("prefill stats = %+v; want 2 prefills, 1 served, 1 block held", s)
	}
}

// TestCommandLine checks exit codes and messages for bad command lines.
func TestCommandLine(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		env     []string
		code    int
		message string
	}{
		{[]string{}, nil, 2, "Usage: pdq <command>"},
		{[]string{"nonsense"}, nil, 2, `unknown command "nonsense"`},
		{[]string{"sim", "--nixl-protocol", "v3"}, nil, 1, "nixl-protocol must be v1 or v2"},
		{[]string{"sim", "--fault-kind", "boom", "--fault-rate", "1"}, nil, 1, "unknown fault kind"},
		{[]string{"sim", "--itl", "fast"}, nil, 2, "invalid value"},
		{[]string{"sim", "extra"}, nil, 2, "unexpected arguments"},
		{[]string{"sim"}, []string{"PDQ_LOG_LEVEL=loud"}, 1, "PDQ_LOG_LEVEL"},
		{[]string{"help"}, nil, 0, "Commands:"},
		{[]string{"sim", "-h"}, nil, 0, "-nixl-protocol"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, pdqBinary, tc.args...)
			cmd.Env = append(os.Environ(), tc.env...)
			out, err := cmd.CombinedOutput()
			code := 0
			var exitErr *exec.ExitError
			if errors.As(err, &exitErr) {
				code = exitErr.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if code != tc.code || !strings.Contains(string(out), tc.message) {
				t.Errorf("exit %d, output %q; want exit %d and %q", code, out, tc.code, tc.message)
			}
		})
	}
}

// dieWithTests has the kernel kill cmd when the test binary's thread that
// started it exits: a test binary that panics (a test's time-out) runs no
// clean-ups, and would leave its engines, workers and NATS servers running.
func dieWithTests(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
