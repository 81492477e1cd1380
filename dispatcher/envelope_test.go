package dispatcher

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
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
		Generation: 3, Origin: 2, Owner: "3f2a", ClientID: "req.1:a b", Submitted: time.UnixMicro(time.Now().UnixMicro()), PromptTokens: 42,
		Body:       json.RawMessage(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`),
		KV:         json.RawMessage(`{"remote_engine_id":"e","remote_block_ids":[1,2],"remote_host":"h","remote_port":5600}`),
		Prefill:    &StageRecord{Stage: StagePrefill, Generation: 3, Worker: "w", Engine: "http://p", Started: started, Ms: 1.5},
		Resume:     &Resume{Chunks: 4, Tokens: 4, Created: 17, Migrations: 1, Original: true},
		Sent:       []byte(" Hello there"),
		ReplyBatch: true, ReplyFramed: true, ReplyStart: true, ReplyPrefilled: true, BatchPrompt: true, HandBacks: 2, RecordRevision: 7, Prefer: "e0a1b2c3d4", PreferDecode: "e5e6f7a8b9",
	}
	// A field added to Job later must be set here too, or this fails.
	// Rebuilt is read, never written: a copy of a job is a new message.
	v := reflect.ValueOf(full).Elem()
	for i := range v.NumField() {
		if name := v.Type().Field(i).Name; v.Field(i).IsZero() && name != "Rebuilt" {
			t.Errorf("the full job leaves %s unset", name)
		}
	}
	rebuilt := full.Msg(StagePrefill)
	rebuilt.Header.Set(HeaderRebuilt, "true")
	if got, err := ParseJob(rebuilt.Header, rebuilt.Data); err != nil || !got.Rebuilt {
		t.Errorf("a job stored again by a rebuild reads back with Rebuilt %v (%v)", got.Rebuilt, err)
	}
	if m := (&Job{ID: "req-3", Model: "m", Pool: "m", Generation: 1, Rebuilt: true}).Msg(StagePrefill); m.Header.Get(HeaderRebuilt) != "" {
		t.Error("a copy of a rebuilt job is written as rebuilt")
	}
	// A prefill job goes to its preferred engine's subject, and says so,
	// with the decode engine it prefers for its handoff; a decode job (a
	// handoff) to its preferred decode engine's subject.
	if m := full.Msg(StagePrefill); m.Subject != PreferredSubject(StagePrefill, "m", "req-1", "e0a1b2c3d4") || m.Header.Get(HeaderPrefer) != "e0a1b2c3d4" {
		t.Errorf("a prefill job preferring an engine: subject %s, header %q", m.Subject, m.Header.Get(HeaderPrefer))
	} else if got, err := ParseJob(m.Header, m.Data); err != nil || got.Prefer != full.Prefer || got.PreferDecode != full.PreferDecode {
		t.Errorf("a prefill job's preferences read back as %q, %q (%v)", got.Prefer, got.PreferDecode, err)
	}
	if m := full.Msg(StageDecode); m.Subject != PreferredSubject(StageDecode, "m", "req-1", "e5e6f7a8b9") || m.Header.Get(HeaderPrefer) != "" {
		t.Errorf("a decode job preferring a decode engine: subject %s, prefill header %q", m.Subject, m.Header.Get(HeaderPrefer))
	}
	if m := (&Job{ID: "req-4", Model: "m", Pool: "m", Generation: 1, Prefer: "e0a1b2c3d4"}).Msg(StageDecode); m.Subject != JobSubject(StageDecode, "m", "req-4") {
		t.Errorf("a decode job preferring no decode engine: subject %s, want the pool's", m.Subject)
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
		want := *job
		want.Prefer = "" // written on prefill jobs only
		if !reflect.DeepEqual(got, &want) {
			t.Errorf("%s read back as\n%+v\nwant\n%+v", job.ID, got, &want)
		}
	}
}

// TestJobPayloadParts checks how a job's payload is read: a handoff stored
// by an older build (version 2, params in a header) keeps its KV, and a
// version 3 payload whose parts do not add up, or name a part this build
// does not know, is refused rather than run without it.
func TestJobPayloadParts(t *testing.T) {
	if writeBody[0] != versionBody[0] {
		t.Skip("built with -tags pdqnext: the versions written are checked by TestNextEnvelope")
	}
	small := json.RawMessage(`{"remote_block_ids":[1]}`)
	if m := (&Job{ID: "req-0", Model: "m", Pool: "m", Endpoint: openai.Chat, Generation: 1, Body: json.RawMessage(`{}`), KV: small}).Msg(StageDecode); m.Header.Get(HeaderVersion) != "2" || m.Header.Get(HeaderKV) != string(small) {
		t.Errorf("a handoff with short params is written as version %s with params %q in the header, want 2: a worker of the build before reads it",
			m.Header.Get(HeaderVersion), m.Header.Get(HeaderKV))
	}
	long := json.RawMessage(`{"remote_block_ids":[` + strings.Repeat("123456,", 3000) + `1]}`)
	job := &Job{ID: "req-1", Model: "m", Pool: "m", Endpoint: openai.Chat, Generation: 1,
		Body: json.RawMessage(`{"model":"m"}`), KV: long}
	m := job.Msg(StageDecode)
	want := fmt.Sprintf("kv=%d", len(long))
	if v, parts := m.Header.Get(HeaderVersion), m.Header.Get(HeaderParts); v != "3" || parts != want || m.Header.Get(HeaderKV) != "" {
		t.Fatalf("a handoff with long params is written as version %s with parts %q, want 3 and %s", v, parts, want)
	}
	if bare := (&Job{ID: "req-2", Model: "m", Pool: "m", Endpoint: openai.Chat, Generation: 1, Body: job.Body}).Msg(StagePrefill); bare.Header.Get(HeaderVersion) != "2" || string(bare.Data) != string(job.Body) {
		t.Errorf("a job without params is written as version %s with payload %s, want 2 and the body alone", bare.Header.Get(HeaderVersion), bare.Data)
	}

	old := job.Msg(StageDecode)
	old.Header.Set(HeaderVersion, "2")
	old.Header.Del(HeaderParts)
	old.Header.Set(HeaderKV, string(job.KV))
	old.Data = job.Body
	if got, err := ParseJob(old.Header, old.Data); err != nil || string(got.KV) != string(job.KV) || string(got.Body) != string(job.Body) {
		t.Errorf("a version 2 handoff read as body %s, params %s (%v)", got.Body, got.KV, err)
	}

	for _, tc := range []struct{ name, parts string }{
		{"no parts", ""},
		{"a part longer than the payload", fmt.Sprintf("kv=%d", len(long)+100)},
		{"a negative length", "kv=-1"},
		{"an unknown part", fmt.Sprintf("kv=%d,original=2", len(long)-2)},
		{"a repeated part", fmt.Sprintf("kv=2,kv=%d", len(long)-2)},
		{"no length", "kv"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := job.Msg(StageDecode)
			m.Header.Set(HeaderParts, tc.parts)
			if got, err := ParseJob(m.Header, m.Data); err == nil {
				t.Errorf("parts %q read as %d bytes of body, %d of params; want an error", tc.parts, len(got.Body), len(got.KV))
			}
		})
	}
}

// TestEnvelopeReadsAs: a job of a version this build does not know is
// read as the version its HeaderReadsAs names, when that is one it
// knows; without one, or with one it does not know, it is refused.
func TestEnvelopeReadsAs(t *testing.T) {
	long := json.RawMessage(`{"remote_block_ids":[` + strings.Repeat("123456,", 3000) + `1]}`)
	for _, tc := range []struct {
		name             string
		kv               json.RawMessage
		version, readsAs string
		ok               bool
	}{
		{"a later body-only job, read as 2", nil, "4", "2", true},
		{"a later job with parts, read as 3", long, "5", "3", true},
		{"a later job, no reads-as", nil, "4", "", false},
		{"a later job, read as a version unknown too", nil, "4", "9", false},
		{"a known version: reads-as ignored", nil, "2", "9", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			job := &Job{ID: "req-n", Model: "m", Pool: "m", Endpoint: openai.Chat, Generation: 1, Body: json.RawMessage(`{"model":"m"}`), KV: tc.kv}
			m := job.Msg(StageDecode)
			m.Header.Set(HeaderVersion, tc.version)
			m.Header.Del(HeaderReadsAs)
			if tc.readsAs != "" {
				m.Header.Set(HeaderReadsAs, tc.readsAs)
			}
			got, err := ParseJob(m.Header, m.Data)
			if tc.ok && (err != nil || string(got.Body) != string(job.Body) || string(got.KV) != string(job.KV)) {
				t.Errorf("read as body %s, %d bytes of params (%v); want the job", got.Body, len(got.KV), err)
			}
			if !tc.ok && !errors.Is(err, ErrEnvelopeVersion) {
				t.Errorf("read with error %v; want ErrEnvelopeVersion", err)
			}
		})
	}
	if m := (&Job{ID: "req-w", Model: "m", Pool: "m", Endpoint: openai.Chat, Generation: 1, Body: json.RawMessage(`{}`)}).Msg(StagePrefill); writeBody[0] == versionBody[0] && m.Header.Get(HeaderReadsAs) != "" {
		t.Errorf("this build writes %s: %q; want none (it writes its own version)", HeaderReadsAs, m.Header.Get(HeaderReadsAs))
	}
}
