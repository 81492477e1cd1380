package reply

import (
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/nats/embedded"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// benchChunk is one token's SSE chunk, as a chat stream sends it.
var benchChunk = []byte(`{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1796000000,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}`)

func BenchmarkReplyChunkMsg(b *testing.B) {
	for _, framed := range []bool{false, true} {
		w := NewWriter(nil, "pdq.reply.gw123456.bench-0123456789abcdef", 1)
		name := "headers"
		if framed {
			w.Frame()
			name = "framed"
		}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			seq := 0
			for b.Loop() {
				seq++
				if m := w.chunkMsg(seq, benchChunk); m == nil {
					b.Fatal("no message")
				}
			}
		})
	}
}

// BenchmarkReplyChunkWire is one token's chunk from a worker's writer,
// through the embedded NATS server, to the gateway's reading of it: the
// whole per-token cost of the reply path in one process, client and
// server, with headers and framed.
func BenchmarkReplyChunkWire(b *testing.B) {
	srv, err := embedded.Start(embedded.Options{DataDir: b.TempDir()}, logging.Discard())
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Shutdown()
	for _, framed := range []bool{false, true} {
		name := "headers"
		if framed {
			name = "framed"
		}
		b.Run(name, func(b *testing.B) {
			pub, err := srv.Connect()
			if err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			sub, err := srv.Connect()
			if err != nil {
				b.Fatal(err)
			}
			defer sub.Close()
			got := make(chan struct{}, 1024)
			s, err := sub.Subscribe("bench.reply", func(m *nats.Msg) {
				if kind, _, _, _, _, err := replyOf(m); err != nil || kind != dispatcher.KindChunk {
					b.Error("not a chunk")
				}
				got <- struct{}{}
			})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Unsubscribe()
			if err := sub.Flush(); err != nil {
				b.Fatal(err)
			}
			w := NewWriter(pub, "bench.reply", 1)
			if framed {
				w.Frame()
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := w.Chunk(benchChunk); err != nil {
					b.Fatal(err)
				}
				w.kept = w.kept[:0]
				<-got
			}
		})
	}
}
