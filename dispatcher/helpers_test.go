package dispatcher

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/nats/embedded"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// startJetStream runs an embedded server with pdq's topology for one test.
func startJetStream(t *testing.T) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	srv, err := embedded.Start(embedded.Options{DataDir: t.TempDir()}, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := srv.Connect()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
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
