package jsonobj

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/internal/testbody"
)

var prefillOps = []Op{
	Set("kv_transfer_params", []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)),
	Set("stream", []byte("false")),
	Set("max_tokens", []byte("1")),
	Replace("max_completion_tokens", []byte("1")),
	Delete("stream_options"),
	Delete("min_tokens"),
	Delete("min_completion_tokens"),
}

// sizes runs fn on a short chat body, a long one with many escapes, a
// long one of plain words, and a long one that opens with a sentence and
// goes on with many escapes.
func sizes(b *testing.B, fn func(b *testing.B, body []byte)) {
	for _, tc := range []struct {
		name string
		body []byte
	}{
		{"1KB", testbody.Chat(1 << 10)},
		{"400KB", testbody.Chat(400 << 10)},
		{"400KB-words", testbody.Words(400 << 10)},
		// A plain sentence, then the escapes of the 400KB body: a long
		// run first, as prompts often open, must not slow the rest.
		{"400KB-opener", bytes.Replace(testbody.Chat(400<<10), []byte(`"content":"`), []byte(`"content":"`+strings.Repeat("Please review this code. ", 4)), 1)},
	} {
		body := tc.body
		if !json.Valid(body) {
			b.Fatal("invalid body")
		}
		b.Run(tc.name, func(b *testing.B) {
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
