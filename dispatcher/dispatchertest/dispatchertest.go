// Package dispatchertest starts what the tests of pdq's JetStream layers
// share: an embedded server with pdq's topology, and the waits on it.
package dispatchertest

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// JetStream runs an embedded server with pdq's topology for one test.
func JetStream(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return JetStreamAt(t, t.TempDir())
}

// JetStreamAt is JetStream with the server's store in dir.
func JetStreamAt(t testing.TB, dir string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := embeddedtest.ConnAt(t, logging.Discard(), dir)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := dispatcher.Ensure(context.Background(), js); err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// Recv is the next value of ch, or the test's end after 10 s.
func Recv[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: not within 10s", what)
		panic("unreachable")
	}
}

// WaitFor polls cond until it holds, or ends the test after 10 s.
func WaitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// BenchJob is a streamed chat job with a body of size bytes and a handoff's
// params, as the benchmarks of the per-request path send it.
func BenchJob(size int) *dispatcher.Job {
	now := time.Now()
	return &dispatcher.Job{ID: "bench-0123456789abcdef", Model: "meta-llama/Llama-3.1-8B-Instruct", Pool: "meta-llama_Llama-3_1-8B-Instruct-1a2b3c4d",
		Endpoint: openai.Chat, Stream: true, Body: bytes.Repeat([]byte("x"), size), ReplyTo: "pdq.reply.gw123456.bench-0123456789abcdef",
		PromptTokens: size / 4, Submitted: now, Deadline: now.Add(10 * time.Minute), Generation: 1,
		KV: []byte(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4],"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.6","remote_port":5600,"tp_size":1}`)}
}
