// Package embeddedtest runs the embedded NATS server for a test, as
// net/http/httptest runs an HTTP server.
package embeddedtest

import (
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/nats/embedded"
)

// Conn starts an embedded server with JetStream, its store in a temporary
// directory, and connects to it in process. Both are closed when the test
// ends.
func Conn(t testing.TB, log *slog.Logger) *nats.Conn {
	t.Helper()
	return ConnAt(t, log, t.TempDir())
}

// ConnAt is Conn with the store in dir, for a test that looks at its files.
func ConnAt(t testing.TB, log *slog.Logger, dir string) *nats.Conn {
	t.Helper()
	srv, err := embedded.Start(embedded.Options{DataDir: dir}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := srv.Connect()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}
