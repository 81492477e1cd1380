package workers

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

func TestNextSlots(t *testing.T) {
	for _, tc := range []struct {
		name                    string
		load                    vllm.Load
		used, slots, most, want int
	}{
		{"full: what it runs, and one more", vllm.Load{Running: 2, Waiting: 30}, 32, 64, 64, 3},
		{"full and large: an eighth more", vllm.Load{Running: 256, Waiting: 9}, 265, 512, 512, 288},
		{"full: never more than now", vllm.Load{Running: 40, Waiting: 1}, 10, 8, 64, 8},
		{"nothing running, one waiting for its KV", vllm.Load{Waiting: 1}, 1, 8, 64, 1},
		{"keeping up with every slot taken: twice", vllm.Load{Running: 4}, 4, 4, 64, 8},
		{"keeping up: no more than PDQ_ENGINE_SLOTS", vllm.Load{Running: 40}, 40, 40, 64, 64},
		{"keeping up with slots to spare: as is", vllm.Load{Running: 3}, 3, 16, 64, 16},
	} {
		if got := nextSlots(tc.load, tc.used, tc.slots, tc.most); got != tc.want {
			t.Errorf("%s: nextSlots(%+v, %d, %d, %d) = %d, want %d", tc.name, tc.load, tc.used, tc.slots, tc.most, got, tc.want)
		}
	}
}

// TestFollowLoad: against a pdq sim engine that runs 2 requests at once,
// a worker's slots start at firstSlots, drop to what the engine runs (and
// one more) once it makes requests wait, tell the gate the 2 it runs, and
// double again once it keeps up. An engine without vLLM's /metrics gets
// PDQ_ENGINE_SLOTS.
func TestFollowLoad(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxNumSeqs, cfg.ITL = 2, 20*time.Millisecond
	engine := simtest.Start(t, cfg)
	w, err := New(nil, nil, Config{Role: dispatcher.StageDecode, EngineURL: engine.URL, Slots: 64}, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	f := loadFollower{w: w}
	f.look(ctx)
	if _, slots, _ := w.slots.Load(); slots != firstSlots {
		t.Fatalf("after a look at an idle engine: %d slots, want %d", slots, firstSlots)
	}

	// 4 jobs in the engine, which runs 2 of them.
	var calls sync.WaitGroup
	for i := range firstSlots {
		if !w.slots.TryAcquire() {
			t.Fatal("a free slot refused")
		}
		calls.Go(func() {
			body := fmt.Sprintf(`{"model":%q,"prompt":"hello there","max_tokens":40,"ignore_eos":true}`, cfg.Model)
			resp, err := w.engine.Post(ctx, openai.Completions, fmt.Sprintf("load-%d", i), []byte(body))
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}
	engine.WaitStats(t, 5*time.Second, "2 running, 2 waiting", func(s sim.Stats) bool { return s.Running == 2 && s.Waiting == 2 })
	f.look(ctx)
	if _, slots, _ := w.slots.Load(); slots != 3 || w.slots.Seats() != 2 {
		t.Errorf("an engine running 2 and queueing 2: %d slots, %d seats; want 3 and 2", slots, w.slots.Seats())
	}
	calls.Wait()
	f.look(ctx) // every slot still taken, nothing waits: twice as many
	if _, slots, _ := w.slots.Load(); slots != 6 {
		t.Errorf("an engine keeping up, every slot taken: %d slots, want 6", slots)
	}

	none := httptest.NewServer(http.NotFoundHandler())
	defer none.Close()
	w2, err := New(nil, nil, Config{Role: dispatcher.StagePrefill, EngineURL: none.URL, Slots: 16}, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	f2 := loadFollower{w: w2}
	if wait := f2.look(ctx); wait != loadRetry {
		t.Errorf("an engine without /metrics is asked again in %v, want %v", wait, loadRetry)
	}
	if _, slots, _ := w2.slots.Load(); slots != 16 || !f2.told {
		t.Errorf("an engine without /metrics: %d slots (told %v), want PDQ_ENGINE_SLOTS (16), said once", slots, f2.told)
	}
}
