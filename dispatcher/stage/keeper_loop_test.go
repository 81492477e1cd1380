package stage

import (
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// At low load each ack empties a stage stream, and the file store then
// replaces the stream's last block with a new file: a file made and one
// removed for every job (about half of the queues' CPU at concurrency 1
// in BenchmarkDurablePath). A loop that takes jobs keeps one message that
// no consumer takes in its stream, so that its last block never empties.
func TestStageLoopKeepsItsStreamsLastBlock(t *testing.T) {
	dir := t.TempDir()
	nc, js := dispatchertest.JetStreamAt(t, dir)
	ctx := context.Background()
	lt := startLoop(t, nc, js, Config{KeepEvery: 20 * time.Millisecond, Handler: func(ctx context.Context, d *Delivery) error {
		d.HandOff([]byte(`{"remote_block_ids":[[1]]}`), dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
		return nil
	}})
	const jobs = 40
	for i := range jobs {
		lt.submit("job-" + strconv.Itoa(i))
		dispatchertest.WaitFor(t, "the ack", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		time.Sleep(2 * time.Millisecond) // refreshes of the keeper come between jobs
	}

	// The block files of PDQ_PREFILL are numbered in the order they were
	// made: one a job without the keeper.
	blocks, err := filepath.Glob(filepath.Join(dir, "jetstream", "*", "streams", dispatcher.StreamPrefill, "msgs", "*.blk"))
	if err != nil || len(blocks) == 0 {
		t.Fatalf("no block files of %s under %s: %v", dispatcher.StreamPrefill, dir, err)
	}
	newest := 0
	for _, b := range blocks {
		n, err := strconv.Atoi(strings.TrimSuffix(filepath.Base(b), ".blk"))
		if err != nil {
			t.Fatalf("block file %s", b)
		}
		newest = max(newest, n)
	}
	if newest > 3 {
		t.Errorf("%d jobs made %d block files of %s, want at most 3", jobs, newest, dispatcher.StreamPrefill)
	}

	// One keeper stays, the older ones purged (a renewal under way as the
	// loop stops ends first), and no consumer took it.
	lt.stop()
	st, err := js.Stream(ctx, dispatcher.StreamPrefill)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(dispatcher.KeeperSubject(dispatcher.StagePrefill)))
	if err != nil {
		t.Fatal(err)
	}
	if n := info.State.Subjects[dispatcher.KeeperSubject(dispatcher.StagePrefill)]; n != 1 {
		t.Errorf("%s holds %d keepers, want 1", dispatcher.StreamPrefill, n)
	}
	if lt.pending(dispatcher.StagePrefill) != 0 {
		t.Errorf("jobs left in %s", dispatcher.StreamPrefill)
	}
}
