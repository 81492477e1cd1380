//go:build pdqnext

package dispatcher

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestNextEnvelope: built with -tags pdqnext, pdq writes a job one
// envelope version higher, marked as readable as the version it stands
// for, and reads it back whole.
func TestNextEnvelope(t *testing.T) {
	long := json.RawMessage(`{"remote_block_ids":[` + strings.Repeat("123456,", 3000) + `1]}`)
	for _, tc := range []struct {
		name             string
		kv               json.RawMessage
		version, readsAs string
	}{
		{"a body-only job", nil, "4", "2"},
		{"a handoff with short params", json.RawMessage(`{"remote_block_ids":[1]}`), "4", "2"},
		{"a handoff with long params", long, "5", "3"},
	} {
		job := &Job{ID: "req-n", Model: "m", Pool: "m", Endpoint: openai.Chat, Generation: 1, Body: json.RawMessage(`{"model":"m"}`), KV: tc.kv}
		m := job.Msg(StageDecode)
		if v, as := m.Header.Get(HeaderVersion), m.Header.Get(HeaderReadsAs); v != tc.version || as != tc.readsAs {
			t.Errorf("%s: written as version %q read as %q; want %s read as %s", tc.name, v, as, tc.version, tc.readsAs)
		}
		got, err := ParseJob(m.Header, m.Data)
		if err != nil || string(got.Body) != string(job.Body) || string(got.KV) != string(job.KV) {
			t.Errorf("%s: read back as body %s, %d bytes of params (%v)", tc.name, got.Body, len(got.KV), err)
		}
	}
}
