package proc

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestWaitLines(t *testing.T) {
	p, err := Start(exec.Command("sh", "-c", `echo one; echo "ready a" >&2; echo two; echo "ready b"; exec sleep 30`))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	lines, err := p.WaitLines(5*time.Second, 2, func(l string) bool { return strings.HasPrefix(l, "ready") })
	if err != nil {
		t.Fatal(err)
	}
	// stdout and stderr are read apart: their lines may come in either
	// order.
	if len(lines) != 2 || !slices.Contains(lines, "ready a") || !slices.Contains(lines, "ready b") {
		t.Errorf("lines %q", lines)
	}
	p.Stop()
	if !p.Exited() || time.Since(start) > 5*time.Second {
		t.Errorf("Stop did not end it at once")
	}
	if got := p.Tail(4); len(strings.Split(got, "\n")) != 4 {
		t.Errorf("Tail(4) = %q", got)
	}
}

func TestWaitLinesFails(t *testing.T) {
	p, err := Start(exec.Command("sh", "-c", `echo "not this"; exit 3`))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.WaitLines(5*time.Second, 1, func(l string) bool { return l == "ready" })
	if err == nil || !strings.Contains(err.Error(), "exited") || !strings.Contains(err.Error(), "not this") {
		t.Errorf("a process that exits: %v", err)
	}
	p, err = Start(exec.Command("sleep", "30"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	if _, err := p.WaitLines(100*time.Millisecond, 1, func(string) bool { return true }); err == nil || !strings.Contains(err.Error(), "not ready within") {
		t.Errorf("a process that says nothing: %v", err)
	}
}
