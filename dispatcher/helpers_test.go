package dispatcher

import (
	"context"
	"testing"

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
