package dispatcher

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestJobEnvelope checks that a job reads back from its message as it was
// written, every field set, flags on and off: a field the envelope drops
// would silently change what a worker does.
func TestJobEnvelope(t *testing.T) {
	started := time.UnixMicro(time.Now().UnixMicro()).UTC()
	full := &Job{
		ID: "req-1", Model: "m", Pool: "m", Endpoint: openai.Chat, Stream: true,
		ReplyTo: ReplySubject("gw", "req-1"), Deadline: time.UnixMilli(time.Now().Add(time.Minute).UnixMilli()),
		Generation: 3, Submitted: time.UnixMicro(time.Now().UnixMicro()), PromptTokens: 42,
		Body:       json.RawMessage(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`),
		KV:         json.RawMessage(`{"remote_engine_id":"e","remote_block_ids":[1,2],"remote_host":"h","remote_port":5600}`),
		Prefill:    &StageRecord{Stage: StagePrefill, Generation: 3, Worker: "w", Engine: "http://p", Started: started, Ms: 1.5},
		Resume:     &Resume{Chunks: 4, Tokens: 4, Created: 17, Migrations: 1},
		ReplyBatch: true, ReplyFramed: true, BatchPrompt: true, HandBacks: 2, RecordRevision: 7,
	}
	// A field added to Job later must be set here too, or this fails.
	v := reflect.ValueOf(full).Elem()
	for i := range v.NumField() {
		if v.Field(i).IsZero() {
			t.Errorf("the full job leaves %s unset", v.Type().Field(i).Name)
		}
	}
	bare := &Job{ID: "req-2", Model: "m", Pool: "m", Endpoint: openai.Completions, Generation: 1,
		Submitted: time.UnixMicro(time.Now().UnixMicro()), Body: json.RawMessage(`{"prompt":"x"}`)}
	for _, job := range []*Job{full, bare} {
		m := job.Msg(StageDecode)
		got, err := ParseJob(m.Header, m.Data)
		if err != nil {
			t.Fatalf("%s: %v", job.ID, err)
		}
		// Times compare by instant: the message carries no location.
		for _, p := range []*time.Time{&got.Deadline, &got.Submitted, &job.Deadline, &job.Submitted} {
			if !p.IsZero() {
				*p = p.UTC()
			}
		}
		if got.Prefill != nil {
			got.Prefill.Started = got.Prefill.Started.UTC()
		}
		if !reflect.DeepEqual(got, job) {
			t.Errorf("%s read back as\n%+v\nwant\n%+v", job.ID, got, job)
		}
	}
}
