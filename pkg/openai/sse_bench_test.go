package openai

import (
	"bytes"
	"io"
	"net/http"
	"testing"
)

var benchChunk = []byte(`{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1796000000,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}`)

// discardWriter is an http.ResponseWriter and Flusher that keeps nothing.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}

func BenchmarkSSEWrite(b *testing.B) {
	w := NewSSEWriter(&discardWriter{h: http.Header{}})
	b.ReportAllocs()
	for b.Loop() {
		if err := w.Data(benchChunk); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSSERead(b *testing.B) {
	const events = 64
	var stream bytes.Buffer
	for range events {
		stream.WriteString("data: ")
		stream.Write(benchChunk)
		stream.WriteString("\n\n")
	}
	raw := stream.Bytes()
	b.ReportAllocs()
	b.SetBytes(int64(len(raw)) / events)
	for b.Loop() {
		r := NewSSEReader(bytes.NewReader(raw))
		for {
			if _, err := r.Next(); err == io.EOF {
				break
			} else if err != nil {
				b.Fatal(err)
			}
		}
	}
}
