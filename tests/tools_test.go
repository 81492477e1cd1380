package tests

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestToolsOutput: what the operator's tools print as a script or a pipe
// reads it. With nothing failed, `pdq requests --failed --json` is an
// empty list, not null; a flag after the id is a flag, not a usage error;
// `pdq status --watch` into a pipe writes no screen codes; `pdq version`
// names the commit it was built from.
func TestToolsOutput(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	run := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, pdqBinary, append(args, "--nats", c.natsURL)...).CombinedOutput()
		return string(out), err
	}

	if out, err := run("requests", "--failed", "--json"); err != nil || strings.TrimSpace(out) != "[]" {
		t.Errorf("pdq requests --failed --json with nothing failed: %v\n%s\nwant []", err, out)
	}
	if out, err := run("requests", "no-such-request", "--json"); err == nil || strings.Contains(out, "Usage:") || !strings.Contains(out, "no such request") {
		t.Errorf("pdq requests ID --json: %v\n%s\nwant the lookup's error, not the usage", err, out)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	out, _ := exec.CommandContext(ctx, pdqBinary, "status", "--watch", "300ms", "--nats", c.natsURL).Output()
	if strings.Contains(string(out), "\x1b[") || strings.Count(string(out), "WORKER") < 2 {
		t.Errorf("pdq status --watch into a pipe: want the status at least twice and no screen codes, got %q", out)
	}

	if out, err := exec.Command(pdqBinary, "status", "--nats", "nats://127.0.0.1:1").CombinedOutput(); err == nil || !strings.Contains(string(out), "PDQ_NATS_LISTEN") {
		t.Errorf("pdq status with no NATS to reach: %v\n%s\nwant a hint of what to set", err, out)
	}

	// pdq version says what the build stamped: the commit, or that it has
	// none (a build outside a checkout, or in a git worktree, which go
	// build does not read).
	stamped, err := exec.Command("go", "version", "-m", pdqBinary).Output()
	if err != nil {
		t.Fatal(err)
	}
	want := "built without VCS information"
	for _, line := range strings.Split(string(stamped), "\n") {
		if _, rev, ok := strings.Cut(line, "vcs.revision="); ok {
			want = "commit " + rev[:min(12, len(rev))]
		}
	}
	if out, err := exec.Command(pdqBinary, "version").Output(); err != nil || !strings.Contains(string(out), want) {
		t.Errorf("pdq version: %v %q, want %q", err, out, want)
	}
}

// TestUnknownVariableWarned: a mistyped PDQ_ variable is not ignored in
// silence: the service says so at start, with the name it meant.
func TestUnknownVariableWarned(t *testing.T) {
	p := startPDQ(t, []string{"PDQ_ENGINE_SLOT=3", "PDQ_HTTP_ADDR=127.0.0.1:0", "PDQ_NATS_URL=nats://127.0.0.1:1"}, "gateway")
	rec := p.waitLog(t, "unknown PDQ_ variable: ignored; did you mean PDQ_ENGINE_SLOTS?")
	if rec["name"] != "PDQ_ENGINE_SLOT" || rec["level"] != "WARN" {
		t.Errorf("the warning: %v", rec)
	}
}
