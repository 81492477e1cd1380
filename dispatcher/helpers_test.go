package dispatcher

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
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

func recv[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: not within 10s", what)
		panic("unreachable")
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
