package dispatcher

import (
	"bytes"
	"context"
	"encoding/json"
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

// BenchmarkRecordRead is a stage's read of a request's record at
// admission, through the embedded server: decoded, and left undecoded
// because it is still at the revision its job was queued under; and, to
// compare, through the KeyValue's Get, decoded.
func BenchmarkRecordRead(b *testing.B) {
	_, js := startJetStream(b)
	ctx := context.Background()
	records, err := OpenRecords(ctx, js)
	if err != nil {
		b.Fatal(err)
	}
	job := benchJob(1 << 10)
	rec := &Record{ID: job.ID, State: StateQueued, Generation: 1, Model: job.Model, Pool: job.Pool, Endpoint: job.Endpoint,
		Stream: true, Gateway: job.GatewayID(), Created: job.Submitted, Updated: job.Submitted, Deadline: job.Deadline}
	rev, err := records.Create(ctx, rec)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("kv-get", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			e, err := records.kv.Get(ctx, job.ID)
			if err != nil {
				b.Fatal(err)
			}
			var r Record
			if err := json.Unmarshal(e.Value(), &r); err != nil {
				b.Fatal(err)
			}
		}
	})
	for _, tc := range []struct {
		name string
		rev  uint64
	}{{"decoded", 0}, {"unchanged", rev}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := records.GetChanged(ctx, job.ID, tc.rev); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
