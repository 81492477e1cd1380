package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/tools/internal/proc"
)

// buildBase builds pdq at the baseline commit, in a worktree of its own.
func buildBase(o options) (string, error) {
	dir := filepath.Join(o.work, "base")
	if out, err := exec.Command("git", "worktree", "add", "--detach", dir, o.base).CombinedOutput(); err != nil {
		return "", fmt.Errorf("git worktree add %s: %w\n%s", o.base, err, out)
	}
	defer exec.Command("git", "worktree", "remove", "--force", dir).Run()
	bin := filepath.Join(o.work, "pdq-base")
	return bin, proc.Build(dir, "./cmd/pdq", bin)
}

// startSim runs pdq sim on free loopback ports and returns its URL and
// process.
func startSim(ctx context.Context, bin string, latency []string) (string, *exec.Cmd, error) {
	port, err := freePort()
	if err != nil {
		return "", nil, err
	}
	args := append([]string{"sim", "--addr", "127.0.0.1:" + strconv.Itoa(port), "--kv-host", "127.0.0.1", "--kv-port", "0",
		"--max-num-seqs", "1024"}, latency...)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "PDQ_LOG_LEVEL=warn")
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	if err := waitHTTP(url + "/health"); err != nil {
		stop(cmd)
		return "", nil, err
	}
	return url, cmd, nil
}

// startUp runs pdq up in front of the engines and returns its URL.
func startUp(ctx context.Context, bin, work, prefill, decode string, env []string) (*exec.Cmd, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	data, err := os.MkdirTemp(work, "data-")
	if err != nil {
		return nil, "", err
	}
	cmd := exec.CommandContext(ctx, bin, "up")
	cmd.Env = append(os.Environ(), "PDQ_HTTP_ADDR=127.0.0.1:"+strconv.Itoa(port), "PDQ_DATA_DIR="+data,
		"PDQ_PREFILL_ENGINES="+prefill, "PDQ_DECODE_ENGINES="+decode, "PDQ_LOG_LEVEL=warn", "PDQ_LOG_FORMAT=json",
		"PDQ_ENGINE_SLOTS=256")
	cmd.Env = append(cmd.Env, env...) // later settings win
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	if err := proc.WaitServing(ctx, url, 30*time.Second); err != nil {
		stop(cmd)
		return nil, "", err
	}
	return cmd, url, nil
}

// startProxy runs the plain proxy in front of the engines and returns its
// URL.
func startProxy(ctx context.Context, bin, prefill, decode string) (*exec.Cmd, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	cmd := exec.CommandContext(ctx, bin, "-addr", strings.TrimPrefix(url, "http://"), "-prefill", prefill, "-decode", decode)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	if err := proc.WaitServing(ctx, url, 30*time.Second); err != nil {
		stop(cmd)
		return nil, "", err
	}
	return cmd, url, nil
}

func waitHTTP(url string) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := client.Get(url); err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s did not answer within 10 s", url)
}

func stop(cmd *exec.Cmd) {
	cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// procStats reads a process's CPU time (user and system) and peak RSS.
func procStats(pid int) (time.Duration, int64, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// Fields after the command name, which is in parentheses.
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	if len(fields) < 13 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	const ticks = 100 // USER_HZ on Linux
	cpu := time.Duration(utime+stime) * time.Second / ticks
	// The same in nanoseconds, where the scheduler's statistics are on:
	// user and system time come in 10 ms ticks, and a run of a few dozen
	// requests takes only a few dozen of them. A thread that ended is not
	// in the sum; the Go runtime rarely ends one.
	if tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid)); err == nil && len(tasks) > 0 {
		var ns int64
		for _, task := range tasks {
			if b, err := os.ReadFile(task); err == nil {
				if f := strings.Fields(string(b)); len(f) > 0 {
					n, _ := strconv.ParseInt(f[0], 10, 64)
					ns += n
				}
			}
		}
		if ns > 0 {
			cpu = time.Duration(ns)
		}
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	var rss int64
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			rss = kb << 10
		}
	}
	return cpu, rss, nil
}
