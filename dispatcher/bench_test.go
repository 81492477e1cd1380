package dispatcher

import (
	"bytes"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// The envelope and reply framing on the per-request and per-token paths.

func benchJob(size int) *Job {
	now := time.Now()
	return &Job{ID: "bench-0123456789abcdef", Model: "meta-llama/Llama-3.1-8B-Instruct", Pool: "meta-llama_Llama-3_1-8B-Instruct-1a2b3c4d",
		Endpoint: openai.Chat, Stream: true, Body: bytes.Repeat([]byte("x"), size), ReplyTo: "pdq.reply.gw123456.bench-0123456789abcdef",
		PromptTokens: size / 4, Submitted: now, Deadline: now.Add(10 * time.Minute), Generation: 1,
		KV: []byte(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4],"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.6","remote_port":5600,"tp_size":1}`)}
}

func BenchmarkJobEnvelope(b *testing.B) {
	for _, size := range []int{1 << 10, 400 << 10} {
		job := benchJob(size)
		b.Run(map[int]string{1 << 10: "1KB", 400 << 10: "400KB"}[size], func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(size))
			for b.Loop() {
				m := job.Msg(StageDecode)
				if _, err := ParseJob(m.Header, m.Data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkReplyChunkMsg(b *testing.B) {
	w := NewReplyWriter(nil, "pdq.reply.gw123456.bench-0123456789abcdef", 1)
	chunk := []byte(`{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1796000000,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}`)
	b.ReportAllocs()
	seq := 0
	for b.Loop() {
		seq++
		if m := w.msg(KindChunk, seq, chunk); m == nil {
			b.Fatal("no message")
		}
	}
}
