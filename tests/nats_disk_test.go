package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/admin"
)

// fullDiskRow puts a standalone nats-server's store on a small filesystem
// of its own (a tmpfs the test mounts), fills that filesystem nearly to
// the brim with another file, and sends P/D requests of 1 MB prompts until
// the store cannot write. Clients must get clear errors, not hang; once
// the other file is gone, service must resume by itself (no restart of
// anything), acked work must not stay in the store, and every id that
// failed must be served when sent again.
func fullDiskRow(t *testing.T) row {
	dir := t.TempDir()
	store := filepath.Join(dir, "store")
	if err := os.Mkdir(store, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", store).CombinedOutput(); err != nil {
		t.Skipf("a full disk needs a filesystem of its own: mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", store).Run() })

	node := natsNode{name: "standalone", client: freeAddr(t)}
	ns := startNATSServer(t, node, writeNATSConf(t, dir, node, nil, ""))
	engine := []string{"--max-model-len", "4000000", "--prefill-per-token", "0", "--kv-transfer-per-block", "0", "--kv-lease", "60s"}
	c := startClusterOn(t, ns.url, clusterOptions{prefillSim: engine, decodeSim: engine,
		env: []string{"PDQ_ACK_WAIT=5s", fmt.Sprintf("PDQ_STALL_TIMEOUT=%v", natsStallTimeout)}})
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()

	// Other files take the filesystem's room: ballast2 all of it, then
	// ballast all but 6 MiB.
	ballast := filepath.Join(store, "ballast")
	// First not a byte is left, and small requests come: every store
	// they write to fails, the request records' first.
	fill(t, store, filepath.Join(store, "ballast2"), 0)
	small := func(int) body { return completionBody(model, longPrompt, body{"max_tokens": 4, "ignore_eos": true}) }
	smalls := c.load(4, "disk-small", 0, small)
	if err := os.Remove(filepath.Join(store, "ballast2")); err != nil {
		t.Fatal(err)
	}
	// Then 6 MiB are left, and large requests come.
	fill(t, store, ballast, 6<<20)
	prompt := strings.Repeat("lorem ipsum dolor sit amet ", (1<<20)/27)
	big := func(int) body {
		return completionBody(model, prompt, body{"max_tokens": 4, "ignore_eos": true})
	}
	const n = 16
	outs := c.load(n, "disk", 0, big)
	r := row{scenario: "a full JetStream disk, then space freed"}
	tally(&r, outs)
	tally(&r, smalls)
	failed := 0
	for i, o := range outs {
		if !o.ok {
			failed++
		}
		if !o.ok && o.status == 0 {
			t.Logf("disk-%d, while the disk was full: no answer (%s)", i, o.err)
		}
	}
	for i, o := range smalls {
		if !o.ok {
			failed++
		}
		if !o.ok && o.status == 0 {
			t.Logf("disk-small-%d, while the disk was full: no answer (%s)", i, o.err)
		}
	}
	// While it is full, it shows: /ready, the metric, pdq status.
	visible := time.Now().Add(15 * time.Second)
	for {
		notReady := readyStatus(c.url) == http.StatusServiceUnavailable
		metric := false
		if m, err := tryDo(http.MethodGet, c.url+"/metrics", nil, nil); err == nil {
			for _, line := range strings.Split(string(m.body), "\n") {
				metric = metric || strings.HasPrefix(line, "pdq_store_writable{") && strings.HasSuffix(line, " 0")
			}
		}
		shown := false
		if out, err := exec.Command(pdqBinary, "status", "--json", "--nats", c.natsURL).Output(); err == nil {
			var st struct{ Stores []admin.StoreHealth }
			if json.Unmarshal(out, &st) == nil {
				for _, h := range st.Stores {
					shown = shown || !h.Stores
				}
			}
		}
		if notReady && metric && shown {
			break
		}
		if time.Now().After(visible) {
			t.Errorf("the full store does not show: /ready 503 %v, a pdq_store_writable at 0 %v, in pdq status %v", notReady, metric, shown)
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	for _, f := range []string{ballast, filepath.Join(store, "ballast2")} {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	freed := time.Now()

	// Service resumes by itself.
	var back time.Duration
	for i := 0; ; i++ {
		o := c.one(fmt.Sprintf("after-%d", i), 10*time.Second, big(i))
		if o.ok {
			back = time.Since(freed)
			break
		}
		if time.Since(freed) > 30*time.Second {
			t.Fatalf("no request served 30 s after space freed: the last got %d %s %s", o.status, o.err, o.tail)
		}
		time.Sleep(500 * time.Millisecond)
	}
	// Every id that failed is served when sent again.
	for i, o := range outs {
		if o.ok {
			continue
		}
		if again := c.one(fmt.Sprintf("disk-%d", i), 20*time.Second, big(i)); !again.ok {
			t.Errorf("disk-%d, which failed while the disk was full (%d), sent again: %d %s %s", i, o.status, again.status, again.err, again.tail)
		}
	}
	for i, o := range smalls {
		if o.ok {
			continue
		}
		if again := c.one(fmt.Sprintf("disk-small-%d", i), 20*time.Second, small(i)); !again.ok {
			t.Errorf("disk-small-%d, which failed while the disk was full (%d), sent again: %d %s %s", i, o.status, again.status, again.err, again.tail)
		}
	}
	r.blocksHeld = c.settle(20 * time.Second)
	// Acked work does not stay in the store: only each stage stream's
	// keeper (see dispatcher/pull/keeper.go) may.
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		name, keeper := dispatcher.StreamPrefill, dispatcher.KeeperSubject(stage)
		if stage == dispatcher.StageDecode {
			name = dispatcher.StreamDecode
		}
		var held map[string]uint64
		deadline := time.Now().Add(10 * time.Second)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if s, err := c.js.Stream(ctx, name); err == nil {
				if info, err := s.Info(ctx, jetstream.WithSubjectFilter(">")); err == nil {
					held = info.State.Subjects
					delete(held, keeper)
				}
			}
			cancel()
			if held != nil && len(held) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("%s holds messages once every request has ended (by subject: %v): want none but its keeper", name, held)
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	if got := readyStatus(c.url); got != http.StatusOK {
		t.Errorf("/ready after space freed: %d, want 200", got)
	}
	r.cost = fmt.Sprintf("%d of %d failed while full; served again %v after space freed", failed, n+len(smalls), back.Round(100*time.Millisecond))
	return r
}

// fill writes a file at path that leaves free bytes free on dir's
// filesystem (none if it has no more).
func fill(t *testing.T, dir, path string, free uint64) {
	t.Helper()
	var fs syscall.Statfs_t
	if err := syscall.Statfs(dir, &fs); err != nil {
		t.Fatal(err)
	}
	have := fs.Bavail * uint64(fs.Bsize)
	if have <= free {
		return
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// A short write is the filesystem full: what was wanted.
	f.Write(make([]byte, have-free))
}
