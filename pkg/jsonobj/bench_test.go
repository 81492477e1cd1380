package jsonobj

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// chatBody is a chat request of about size bytes, most of it one user
// message with markup, quotes, newlines and non-ASCII text.
func chatBody(size int) []byte {
	const line = "The <b>quick</b> brown fox & \"friends\" jump over the lazy dog: ünïcödé, 漢字.\n"
	text := strings.Repeat(line, size/len(line)+1)
	content, _ := json.Marshal(text)
	head := `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":`
	tail := `}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":256,"temperature":0.7}`
	// Cut the text so that the whole body is size bytes, at a rune and
	// escape boundary: re-encode a shorter text until it fits.
	for n := len(text); len(head)+len(content)+len(tail) > size && n > 0; n -= max(1, (len(head)+len(content)+len(tail)-size)/2) {
		content, _ = json.Marshal(strings.ToValidUTF8(text[:n], ""))
	}
	return []byte(head + string(content) + tail)
}

var prefillOps = []Op{
	Set("kv_transfer_params", []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)),
	Set("stream", []byte("false")),
	Set("max_tokens", []byte("1")),
	Replace("max_completion_tokens", []byte("1")),
	Delete("stream_options"),
	Delete("min_tokens"),
	Delete("min_completion_tokens"),
}

func sizes(b *testing.B, fn func(b *testing.B, body []byte)) {
	for _, size := range []int{1 << 10, 400 << 10} {
		body := chatBody(size)
		if !json.Valid(body) {
			b.Fatal("invalid body")
		}
		b.Run(fmt.Sprintf("%dKB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			fn(b, body)
		})
	}
}

// BenchmarkEdit is the prefill leg's edit of a chat body: B/op should be
// about the body's size, the one output buffer.
func BenchmarkEdit(b *testing.B) {
	sizes(b, func(b *testing.B, body []byte) {
		for b.Loop() {
			if _, err := Edit(body, prefillOps...); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkDeleteFoldNone is the gateway's check for a client's
// kv_transfer_params in a body without any: a scan, nothing allocated.
func BenchmarkDeleteFoldNone(b *testing.B) {
	sizes(b, func(b *testing.B, body []byte) {
		for b.Loop() {
			if _, err := Edit(body, DeleteFold("kv_transfer_params")); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkGet(b *testing.B) {
	sizes(b, func(b *testing.B, body []byte) {
		for b.Loop() {
			if _, _, err := Get(body, "max_tokens"); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkMapEdit is what Edit replaces: decoding into a map of raw
// values, setting and deleting keys, and encoding again.
func BenchmarkMapEdit(b *testing.B) {
	sizes(b, func(b *testing.B, body []byte) {
		for b.Loop() {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(body, &m); err != nil {
				b.Fatal(err)
			}
			for _, op := range prefillOps {
				switch op.kind {
				case opSet:
					m[op.key] = op.value
				case opReplace:
					if _, ok := m[op.key]; ok {
						m[op.key] = op.value
					}
				default:
					delete(m, op.key)
				}
			}
			if _, err := json.Marshal(m); err != nil {
				b.Fatal(err)
			}
		}
	})
}
