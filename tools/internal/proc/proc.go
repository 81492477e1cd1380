// Package proc starts, watches and stops the processes that the
// benchmark tools run: pdq sim engines, pdq up, the plain proxy. Every
// line a process writes is kept, so that a tool can wait for the line
// that says where it listens, and show the last lines when it fails.
package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// Build builds the package pkg (as ./cmd/pdq) of the module in dir into
// the binary out.
func Build(dir, pkg, out string) error {
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = dir
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s in %s: %w\n%s", pkg, dir, err, b)
	}
	return nil
}

// maxLines is how many lines of a process are kept: the first ones, which
// say where it listens; a process that writes more is not waited on for
// later lines.
const maxLines = 10000

// Proc is a running process and the lines it wrote.
type Proc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when it has exited
	err  error         // its exit, once done: written by the waiting goroutine before done closes

	// mu guards lines, which the output readers' goroutines append to and
	// callers read.
	mu    sync.Mutex
	lines []string
}

// Start starts cmd, with its stdout and stderr read into lines. The
// process is killed if this one dies (on Linux).
func Start(cmd *exec.Cmd) (*Proc, error) {
	p := &Proc{cmd: cmd, done: make(chan struct{})}
	cmd.Stdout = &lineWriter{p: p}
	cmd.Stderr = &lineWriter{p: p}
	// A child of the process that keeps its output open does not keep
	// Wait, and so Stop, waiting.
	cmd.WaitDelay = time.Second
	setDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Pid is the process's id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Lines are the lines it wrote so far, stdout's and stderr's as they came.
func (p *Proc) Lines() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.lines...)
}

// Tail is its last n lines, for an error message.
func (p *Proc) Tail(n int) string {
	l := p.Lines()
	return strings.Join(l[max(len(l)-n, 0):], "\n")
}

// WaitLines waits until the process has written n lines that match, and
// returns them. It fails when the process exits first, or after timeout.
func (p *Proc) WaitLines(timeout time.Duration, n int, match func(string) bool) ([]string, error) {
	deadline := time.Now().Add(timeout)
	var found []string
	seen := 0
	for {
		lines := p.Lines()
		for ; seen < len(lines) && len(found) < n; seen++ {
			if match(lines[seen]) {
				found = append(found, lines[seen])
			}
		}
		if len(found) == n {
			return found, nil
		}
		select {
		case <-p.done:
			if l := p.Lines(); len(l) > seen {
				continue // lines written before it exited
			}
			return nil, fmt.Errorf("%s exited (%v) before it was ready:\n%s", p.cmd.Path, p.err, p.Tail(20))
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s was not ready within %v:\n%s", p.cmd.Path, timeout, p.Tail(20))
		}
	}
}

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop interrupts the process and waits for it to exit; after 10 s it is
// killed.
func (p *Proc) Stop() {
	if p == nil {
		return
	}
	p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// lineWriter splits what a process writes into lines.
type lineWriter struct {
	p       *Proc
	partial []byte
}

func (w *lineWriter) Write(b []byte) (int, error) {
	w.partial = append(w.partial, b...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		w.p.mu.Lock()
		if len(w.p.lines) < maxLines {
			w.p.lines = append(w.p.lines, string(w.partial[:i]))
		}
		w.p.mu.Unlock()
		w.partial = w.partial[i+1:]
	}
	return len(b), nil
}

// WaitServing waits until a router (pdq up, the plain proxy) at url
// answers a completion through both legs: a 64-word prompt, long enough
// for pdq to send it through prefill, and one output token.
func WaitServing(ctx context.Context, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	body := `{"model":"pdq-sim","prompt":"` + strings.Repeat("word ", 64) + `","max_tokens":1}`
	client := &http.Client{Timeout: 5 * time.Second}
	var last error
	for time.Now().Before(deadline) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
		}
		last = err
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s did not serve within %v: %w", url, timeout, errors.Join(last))
}
