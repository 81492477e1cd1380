package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
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

	// Read until the status came twice (the first may wait up to 2 s for
	// the workers' beats), for at most 10 s.
	watch := exec.Command(pdqBinary, "status", "--watch", "300ms", "--nats", c.natsURL)
	pipe, err := watch.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := watch.Start(); err != nil {
		t.Fatal(err)
	}
	stop := time.AfterFunc(10*time.Second, func() { watch.Process.Kill() }) // a read then ends
	defer stop.Stop()
	var out []byte
	for buf := make([]byte, 4096); strings.Count(string(out), "WORKER") < 2; {
		n, err := pipe.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			break
		}
	}
	watch.Process.Kill()
	watch.Wait()
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

// TestToolsReachUp: the README's lines after `make run` work as written:
// pdq up, started with no NATS settings, lets the tools join its NATS on
// their default address with no flag or variable.
func TestToolsReachUp(t *testing.T) {
	if ln, err := net.Listen("tcp", "127.0.0.1:4222"); err != nil {
		t.Skipf("NATS's default port is taken here (%v): pdq up listens elsewhere, as TestUpNATSListen checks", err)
	} else {
		ln.Close()
	}
	up, _ := startUp(t, "-PDQ_NATS_LISTEN")
	up.waitStdout(t, "join it as they are")
	if out, err := toolRun(t, nil, "status"); err != nil || !strings.Contains(out, "WORKER") {
		t.Fatalf("pdq status after pdq up, with no flags: %v\n%s", err, out)
	}
}

// toolRun runs a pdq tool as the README gives them: no PDQ_ variable but
// env.
func toolRun(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, pdqBinary, args...)
	cmd.Env = append(slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "PDQ_") }), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestUpNATSListen: where pdq up's NATS listens when nothing says. With
// NATS's default port taken, on a free one, with a warning, and pdq up
// prints the flag the tools then need; not at all while the gateway wants
// API keys and NATS has no credentials (the NATS would let anyone on the
// machine around the keys); with PDQ_NATS_TOKEN, only for clients that
// give it.
func TestUpNATSListen(t *testing.T) {
	t.Run("default taken", func(t *testing.T) {
		// Held here, or by another process: taken either way.
		if ln, err := net.Listen("tcp", "127.0.0.1:4222"); err == nil {
			defer ln.Close()
		}
		up, _ := startUp(t, "-PDQ_NATS_LISTEN")
		up.waitLog(t, "NATS's default address is taken: the embedded NATS listens on a free port instead (pdq up prints it); set PDQ_NATS_LISTEN to choose")
		out := up.waitStdout(t, "tools join it with --nats ")
		m := regexp.MustCompile(`tools join it with --nats (nats://127\.0\.0\.1:\d+)`).FindStringSubmatch(out)
		if m == nil || strings.HasSuffix(m[1], ":4222") {
			t.Fatalf("pdq up's NATS line:\n%s", out)
		}
		if out, err := toolRun(t, nil, "status", "--nats", m[1]); err != nil || !strings.Contains(out, "WORKER") {
			t.Errorf("pdq status --nats %s: %v\n%s", m[1], err, out)
		}
	})
	t.Run("API keys without NATS credentials", func(t *testing.T) {
		up := startPDQ(t, []string{"-PDQ_NATS_LISTEN", "PDQ_API_KEYS=k1", "PDQ_DATA_DIR=" + t.TempDir(), "PDQ_HTTP_ADDR=127.0.0.1:0"}, "up")
		if out := up.waitStdout(t, "NATS:"); !strings.Contains(out, "in-process only (PDQ_API_KEYS is set and NATS has no credentials") {
			t.Errorf("pdq up with API keys opened its NATS without credentials:\n%s", out)
		}
	})
	t.Run("token", func(t *testing.T) {
		up, _ := startUp(t, "PDQ_NATS_TOKEN=t0k3n")
		url := up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
		if out, err := toolRun(t, nil, "status", "--nats", url); err == nil || !strings.Contains(out, "PDQ_NATS_TOKEN") {
			t.Errorf("pdq status without the token: %v\n%s\nwant refused, naming what to set", err, out)
		}
		if out, err := toolRun(t, []string{"PDQ_NATS_TOKEN=t0k3n"}, "status", "--nats", url); err != nil || !strings.Contains(out, "WORKER") {
			t.Errorf("pdq status with the token: %v\n%s", err, out)
		}
	})
}

// TestFailedRecordsAndReplay: what the tools show of requests that failed.
// A failed request's record keeps the stage runs it failed in; a request
// sent with an X-Request-Id that is no subject token is found by that id;
// `pdq replay` says how far it has got, and with --wait how each ended.
func TestFailedRecordsAndReplay(t *testing.T) {
	_, pe := startSimProcess(t)
	_, de := startSimProcess(t, "--fault-kind", "500", "--fault-rate", "1")
	// Not startUp: it waits for a request to succeed.
	up := startPDQ(t, []string{"PDQ_DATA_DIR=" + t.TempDir(), "PDQ_HTTP_ADDR=127.0.0.1:0",
		"PDQ_PREFILL_ENGINES=" + pe.URL, "PDQ_DECODE_ENGINES=" + de.URL}, "up")
	url := "http://" + up.waitLog(t, "gateway listening")["addr"].(string)
	natsURL := up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
	up.waitStdout(t, "pdq is up")
	tool := func(args ...string) (string, error) { return toolRun(t, nil, append(args, "--nats", natsURL)...) }

	// The third is no subject token: it runs under a hashed key, and the
	// tools find it by the client's id all the same.
	ids := []string{"tools-a", "tools-b", "tools c:1"}
	thirdKey, _ := dispatcher.RequestKey(ids[2])
	for _, id := range ids {
		post(t, url+"/v1/completions", id, completionBody(model, longPrompt, body{"max_tokens": 4})).wantStatus(t, http.StatusBadGateway)
	}
	out, err := tool("requests", "--failed")
	for _, id := range ids {
		if err != nil || !strings.Contains(out, id) {
			t.Fatalf("pdq requests --failed: %v\n%s\nwant %s listed", err, out, id)
		}
	}
	out, err = tool("requests", ids[2], "--json")
	var rec dispatcher.Record
	if err != nil || json.Unmarshal([]byte(out), &rec) != nil || rec.ID != thirdKey || rec.ClientID != ids[2] {
		t.Fatalf("pdq requests %q --json: %v\n%s", ids[2], err, out)
	}
	out, err = tool("requests", ids[0], "--json")
	rec = dispatcher.Record{}
	if err != nil || json.Unmarshal([]byte(out), &rec) != nil {
		t.Fatalf("pdq requests %s --json: %v\n%s", ids[0], err, out)
	}
	if rec.State != dispatcher.StateFailed || len(rec.Stages) == 0 {
		t.Fatalf("a failed request's record: state %s, stages %+v; want failed, with the stage runs", rec.State, rec.Stages)
	}
	last := rec.Stages[len(rec.Stages)-1]
	if last.Stage != dispatcher.StageDecode || last.Engine != de.URL || last.Worker == "" || last.Started.IsZero() {
		t.Errorf("the last stage run of a request that failed in decode: %+v", last)
	}

	// Replay runs them again (the decode engine still fails); it says how
	// far it has got as it goes, one line a request, and how many are left.
	out, err = tool("replay", "--failed", "--since", "1h", "--wait")
	if err == nil || !strings.Contains(out, "3 of 3 replayed requests did not succeed") {
		t.Fatalf("pdq replay --failed --wait: %v\n%s", err, out)
	}
	for i, id := range []string{ids[0], ids[1], thirdKey} {
		if !strings.Contains(out, fmt.Sprintf("[%d/3] %s: replaying", i+1, id)) ||
			!regexp.MustCompile(`\[\d/3 ended\] `+regexp.QuoteMeta(id)+`( \(X-Request-Id "[^"]*"\))?: failed \(502 `).MatchString(out) {
			t.Errorf("pdq replay: no progress line for %s, or no end line:\n%s", id, out)
		}
	}
	if !strings.Contains(out, "[3/3 ended]") {
		t.Errorf("pdq replay --wait: no count of the ended:\n%s", out)
	}

	// One again by the client's id, and its end shows that id.
	out, err = tool("replay", "--id", ids[2], "--wait")
	if err == nil || !strings.Contains(out, "[1/1] "+thirdKey+": replaying") ||
		!strings.Contains(out, fmt.Sprintf("[1/1 ended] %s (X-Request-Id %q): failed", thirdKey, ids[2])) {
		t.Errorf("pdq replay --id %q --wait: %v\n%s", ids[2], err, out)
	}
}

// TestPoolNameTool: pdq pool-name prints the names the deploy files take
// from it (a KEDA scaler that names no existing consumer scales to its
// maximum): the pool, and with --consumer the stage's consumer.
func TestPoolNameTool(t *testing.T) {
	const served = "Qwen/Qwen3-8B"
	for args, want := range map[string]string{
		"pool-name " + served:                        dispatcher.PoolName(served),
		"pool-name --consumer prefill " + served:     dispatcher.ConsumerName(dispatcher.StagePrefill, dispatcher.PoolName(served)),
		"pool-name " + served + " --consumer decode": dispatcher.ConsumerName(dispatcher.StageDecode, dispatcher.PoolName(served)),
	} {
		out, err := exec.Command(pdqBinary, strings.Fields(args)...).Output()
		if err != nil || strings.TrimSpace(string(out)) != want {
			t.Errorf("pdq %s: %v %q, want %q", args, err, out, want)
		}
	}
	if err := exec.Command(pdqBinary, "pool-name", "--consumer", "release", served).Run(); err == nil {
		t.Error("pdq pool-name --consumer release: want a usage error")
	}
}
