package stage

import (
	"context"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
)

func TestRetryDelay(t *testing.T) {
	for attempt, want := range map[int]time.Duration{1: 250 * time.Millisecond, 2: time.Second, 3: 4 * time.Second, 4: 10 * time.Second, 9: 10 * time.Second} {
		if got := retryDelay(config.RetryBase, attempt); got != want {
			t.Errorf("retryDelay(%d) = %v, want %v", attempt, got, want)
		}
	}
}

// TestStageLoopTakesEverySetting: NewLoop fills in no default (they
// are config's): a setting left at zero is an error, not a value.
func TestStageLoopTakesEverySetting(t *testing.T) {
	nc := embeddedtest.Conn(t, logging.Discard())
	base := withSettings(Config{Stage: dispatcher.StagePrefill, Pool: "p", Slots: 1,
		Handler: func(context.Context, *Delivery) error { return nil }})
	if _, err := NewLoop(nc, nil, base, logging.Discard()); err != nil {
		t.Fatalf("every setting given: %v", err)
	}
	for name, unset := range map[string]func(*Config){
		"grace":           func(c *Config) { c.Grace = 0 },
		"retry base":      func(c *Config) { c.RetryBase = 0 },
		"pull wait":       func(c *Config) { c.PullWait = 0 },
		"ack wait":        func(c *Config) { c.AckWait = 0 },
		"keep interval":   func(c *Config) { c.KeepEvery = 0 },
		"KV TTL":          func(c *Config) { c.KVTTL = 0 },
		"max generations": func(c *Config) { c.MaxGenerations = 0 },
		"max deliveries":  func(c *Config) { c.MaxDeliver = 0 },
		"stall time-out":  func(c *Config) { c.StallTimeout = 0 },
	} {
		cfg := base
		unset(&cfg)
		if _, err := NewLoop(nc, nil, cfg, logging.Discard()); err == nil {
			t.Errorf("no %s: NewLoop took it", name)
		}
	}
}

// withSettings is cfg with every setting config gives a stage loop, where
// the test left it unset: NewLoop fills in none.
func withSettings(cfg Config) Config {
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{
		{&cfg.Grace, config.DefaultShutdownGrace}, {&cfg.RetryBase, config.RetryBase}, {&cfg.PullWait, config.PullWait},
		{&cfg.AckWait, config.DefaultAckWait}, {&cfg.KeepEvery, config.KeepEvery}, {&cfg.KVTTL, config.DefaultKVTTL},
		{&cfg.StallTimeout, config.DefaultStallTimeout},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if cfg.MaxGenerations == 0 {
		cfg.MaxGenerations = config.DefaultMaxGenerations
	}
	if cfg.MaxDeliver == 0 {
		cfg.MaxDeliver = config.DefaultMaxDeliver
	}
	return cfg
}

// TestHeartbeatRecreatesBucket: a worker whose registry bucket is gone
// (memory storage, lost in a NATS restart) creates it again.
func TestHeartbeatRecreatesBucket(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	if err := js.DeleteKeyValue(ctx, dispatcher.BucketWorkers); err != nil {
		t.Fatal(err)
	}
	id := dispatcher.NewWorkerID(dispatcher.StageDecode)
	startLoop(t, nc, js, Config{Slots: 1, Worker: dispatcher.WorkerInfo{ID: id, Model: "m"},
		Handler: func(context.Context, *Delivery) error { return nil }})
	dispatchertest.WaitFor(t, "the worker's entry in a new bucket", func() bool {
		kv, err := js.KeyValue(ctx, dispatcher.BucketWorkers)
		if err != nil {
			return false
		}
		_, err = kv.Get(ctx, id)
		return err == nil
	})
}
