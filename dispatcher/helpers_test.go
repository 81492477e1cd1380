package dispatcher

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// startJetStream runs an embedded server with pdq's topology for one test.
func startJetStream(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return startJetStreamAt(t, t.TempDir())
}

// startJetStreamAt is startJetStream with the server's store in dir.
func startJetStreamAt(t testing.TB, dir string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := embeddedtest.ConnAt(t, logging.Discard(), dir)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := Ensure(context.Background(), js); err != nil {
		t.Fatal(err)
	}
	if err := Ensure(context.Background(), js); err != nil {
		t.Fatalf("Ensure is not idempotent: %v", err)
	}
	return nc, js
}

// withSettings is cfg with every setting config gives a stage loop, where
// the test left it unset: NewStageLoop fills in none.
func withSettings(cfg StageConfig) StageConfig {
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
