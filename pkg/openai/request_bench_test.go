package openai

import (
	"strings"
	"testing"
)

// BenchmarkDecodeRequest reads a chat request with a 400 KB prompt in a
// text part, as pdq bench and the OpenAI clients send one.
func BenchmarkDecodeRequest(b *testing.B) {
	body := []byte(`{"model":"pdq-sim","stream":true,"max_tokens":8,"messages":[{"role":"user","content":[{"type":"text","text":"` +
		strings.Repeat("word ", 80000) + `"}]}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, e := DecodeRequest(Chat, body); e != nil {
			b.Fatal(e)
		}
	}
}
