package sched

import (
	"context"
	"sync"
	"testing"
	"time"
)

// TestBatcherRealTime drives two requests through a Batcher: each gets
// its tokens, the gauges hook hears them run and end, and a finished
// Prefill's blocks stay held until Release. The engine's tests
// (package sim) run it behind HTTP.
func TestBatcherRealTime(t *testing.T) {
	var (
		mu      sync.Mutex
		running []int
	)
	b, err := NewBatcher(testConfig(), 0, 0, func(r, w int) {
		mu.Lock()
		defer mu.Unlock()
		running = append(running, r+w)
	})
	if err != nil {
		t.Fatal(err)
	}
	local := prompt("local", 40, 1, 3)
	pre := prompt("prefill", 40, 2, 1)
	pre.Kind = Prefill
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, r := range []*Request{local, pre} {
		st, err := b.Add(r)
		if err != nil {
			t.Fatal(err)
		}
		n, done := 0, false
		for !done {
			if n, done, err = b.Wait(ctx, st, n); err != nil {
				t.Fatalf("%s: %v after %d tokens", r.ID, err, n)
			}
		}
		if n != r.MaxTokens {
			t.Errorf("%s: %d tokens, want %d", r.ID, n, r.MaxTokens)
		}
		b.Keep(st)
		b.Close(st)
	}
	if used := b.Stats().UsedBlocks; used != pre.Blocks() || used == 0 {
		t.Errorf("%d blocks in use after both ended, want the prefill's %d held", used, pre.Blocks())
	}
	b.Release(pre)
	if s := b.Stats(); s.UsedBlocks != 0 || s.Running != 0 || s.Waiting != 0 {
		t.Errorf("after Release: %+v, want nothing in use", s)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(running) == 0 || running[len(running)-1] != 0 {
		t.Errorf("gauges heard running+waiting %v, want them to end at 0", running)
	}
}
