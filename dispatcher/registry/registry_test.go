package registry

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// fakeClock is a gateway clock a test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// TestRegistryOwnClock: the gateway judges a worker by when it heard the
// worker, on its own clock; how far the NATS server's clock is off does
// not matter.
func TestRegistryOwnClock(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	for _, skew := range []time.Duration{-time.Hour, time.Hour} {
		t.Run(fmt.Sprintf("gateway clock %v off the server's", skew), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			reg, err := watchWorkers(ctx, js, logging.Discard(), func() time.Time { return time.Now().Add(skew) })
			if err != nil {
				t.Fatal(err)
			}
			// A worker's heartbeat, as the stage loop sends it, then its last word.
			model := "model-" + dispatcher.PoolName(t.Name())
			info := dispatcher.WorkerInfo{ID: dispatcher.NewWorkerID(dispatcher.StagePrefill), Role: dispatcher.StagePrefill, Model: model, Pool: dispatcher.PoolName(model), Slots: 2}
			data, _ := json.Marshal(info)
			if err := nc.Publish(dispatcher.WorkerSubject(info.ID), data); err != nil {
				t.Fatal(err)
			}
			dispatchertest.WaitFor(t, "the worker counted live", func() bool { return reg.Status(model).Prefill == 1 })
			leaving := nats.NewMsg(dispatcher.WorkerSubject(info.ID))
			leaving.Header.Set(dispatcher.HeaderLeaving, "true")
			if err := nc.PublishMsg(leaving); err != nil {
				t.Fatal(err)
			}
			dispatchertest.WaitFor(t, "the worker gone", func() bool { return reg.Status(model).Prefill == 0 })
		})
	}

	t.Run("a worker not heard for LiveFor is dead", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		clock := &fakeClock{t: time.Now().Add(-24 * time.Hour)}
		reg, err := watchWorkers(ctx, js, logging.Discard(), clock.now)
		if err != nil {
			t.Fatal(err)
		}
		// One heartbeat, then silence: a worker that crashed.
		info := dispatcher.WorkerInfo{ID: dispatcher.NewWorkerID(dispatcher.StageDecode), Role: dispatcher.StageDecode, Model: "crashed", Pool: "crashed", Slots: 4}
		data, _ := json.Marshal(info)
		if err := nc.Publish(dispatcher.WorkerSubject(info.ID), data); err != nil {
			t.Fatal(err)
		}
		dispatchertest.WaitFor(t, "the heartbeat heard", func() bool { return reg.Slots(dispatcher.StageDecode, "crashed") == 4 })
		clock.advance(dispatcher.LiveFor)
		if reg.Status("crashed").Decode != 1 {
			t.Errorf("a worker heard LiveFor ago is not live")
		}
		clock.advance(time.Millisecond)
		if s := reg.Status("crashed"); s.Decode != 0 || !s.Known {
			t.Errorf("status %+v; want the silent worker dead, its model known", s)
		}
	})

	t.Run("silence while this process is cut off from NATS is no evidence", func(t *testing.T) {
		clock := &fakeClock{t: time.Now()}
		r := &Registry{now: clock.now, connected: true}
		heard := clock.now()
		clock.advance(time.Second)
		r.connectionChanged(nats.RECONNECTING)
		clock.advance(time.Minute)
		if !r.live(heard, clock.now()) {
			t.Error("a worker heard 1s before NATS went away counts dead while it is away")
		}
		r.connectionChanged(nats.CONNECTED)
		clock.advance(dispatcher.LiveFor - time.Second)
		if !r.live(heard, clock.now()) {
			t.Error("a worker counts dead before its time is up, counted on from the reconnect")
		}
		clock.advance(time.Millisecond)
		if r.live(heard, clock.now()) {
			t.Error("a worker not heard since the reconnect counts live past its time")
		}
		if !r.live(clock.now().Add(-time.Second), clock.now()) {
			t.Error("a worker heard after the reconnect is dead")
		}
	})
}
