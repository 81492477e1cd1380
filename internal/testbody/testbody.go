// Package testbody makes request bodies for tests and benchmarks that
// need a realistic one of a given size.
package testbody

import (
	"encoding/json"
	"strings"
)

// Chat is a chat request of about size bytes, most of it one user message
// with markup, quotes, newlines and non-ASCII text, as clients send long
// prompts.
func Chat(size int) []byte {
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

// Words is a chat body of about size bytes whose prompt is plain words, as
// `pdq bench`'s prompts are: nothing in it needs an escape.
func Words(size int) []byte {
	words := strings.Fields("the quick brown fox jumps over a lazy dog and then some more")
	head := `{"model":"pdq-sim","messages":[{"role":"user","content":"`
	tail := `"}],"stream":true,"max_tokens":8}`
	var b strings.Builder
	b.WriteString(head)
	for i := 0; b.Len()+len(tail) < size; i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(words[i%len(words)])
	}
	b.WriteString(tail)
	return []byte(b.String())
}
