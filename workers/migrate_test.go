package workers

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/internal/testbody"
	"github.com/pdq-dev/pdq/pkg/openai"
)

func TestContinueBody(t *testing.T) {
	for _, tc := range []struct {
		name     string
		endpoint openai.Endpoint
		body     string
		text     string
		tokens   int
		want     string
	}{
		{"completions: the text joins the prompt, limits shrink", openai.Completions,
			`{"model":"m","prompt":"Once","max_tokens":10,"min_tokens":4,"stream":true,"kv_transfer_params":{"x":1}}`, " upon a", 2,
			`{"max_tokens":8,"min_tokens":2,"model":"m","prompt":"Once upon a","stream":true}`},
		{"completions: a prompt list of one", openai.Completions,
			`{"prompt":["Once"],"max_tokens":3}`, " upon a time", 3,
			`{"max_tokens":1,"prompt":"Once upon a time"}`},
		{"completions: min_tokens met is dropped", openai.Completions,
			`{"prompt":"a","min_tokens":2}`, " b c", 2,
			`{"prompt":"a b c"}`},
		{"chat: the text becomes the assistant's open message", openai.Chat,
			`{"messages":[{"role":"user","content":"Hi"}],"max_completion_tokens":5}`, "Hello th", 2,
			`{"add_generation_prompt":false,"continue_final_message":true,"max_completion_tokens":3,"messages":[{"content":"Hi","role":"user"},{"content":"Hello th","role":"assistant"}]}`},
		{"chat: a continued message grows", openai.Chat,
			`{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}],"continue_final_message":true,"add_generation_prompt":false}`, " there", 1,
			`{"add_generation_prompt":false,"continue_final_message":true,"messages":[{"content":"Hi","role":"user"},{"content":"Hello there","role":"assistant"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ContinueBody(tc.endpoint, []byte(tc.body), tc.text, tc.tokens)
			if err != nil {
				t.Fatal(err)
			}
			var g, w any
			json.Unmarshal(got, &g)
			json.Unmarshal([]byte(tc.want), &w)
			if !reflect.DeepEqual(g, w) {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

// A continuation is the client's body with the continued fields spliced
// in: the other fields and messages keep their bytes and order.
func TestContinueBodyKeepsBytes(t *testing.T) {
	for _, tc := range []struct {
		name     string
		endpoint openai.Endpoint
		body     string
		text     string
		tokens   int
		want     string
	}{
		{"completions", openai.Completions,
			`{"prompt": "<s>Once", "model":"m", "max_tokens": 10, "stop":["</s>"], "min_tokens":1}`, " upon \"a\" <time>", 2,
			`{"prompt": "<s>Once upon \"a\" <time>", "model":"m", "max_tokens": 8, "stop":["</s>"]}`},
		{"completions: an escaped prompt stays escaped", openai.Completions,
			`{"prompt":["\u00e9\n"],"max_tokens":3}`, "é\n", 1,
			`{"prompt":"\u00e9\né\n","max_tokens":2}`},
		{"chat: a new assistant message", openai.Chat,
			`{"model":"m","messages":[ {"role":"system","content":"<sys>"}, {"content":"Hi & bye","role":"user"} ],"max_completion_tokens":5}`, "Hello <b>", 2,
			`{"model":"m","messages":[ {"role":"system","content":"<sys>"}, {"content":"Hi & bye","role":"user"},{"role":"assistant","content":"Hello <b>"} ],"max_completion_tokens":3,"continue_final_message":true,"add_generation_prompt":false}`},
		{"chat: the continued message grows", openai.Chat,
			`{"messages":[{"role":"user","content":"Hi"},{"content":"Hel","role":"assistant","name":"x"}],"continue_final_message":true,"add_generation_prompt":false,"kv_transfer_params":{"x":1}}`, "lo", 1,
			`{"messages":[{"role":"user","content":"Hi"},{"content":"Hello","role":"assistant","name":"x"}],"continue_final_message":true,"add_generation_prompt":false}`},
		{"chat: no messages yet", openai.Chat,
			`{"messages":[]}`, "A", 1,
			`{"messages":[{"role":"assistant","content":"A"}],"continue_final_message":true,"add_generation_prompt":false}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ContinueBody(tc.endpoint, []byte(tc.body), tc.text, tc.tokens)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
	for _, body := range []string{`{"prompt":[1]}`, `{"prompt":["a","b"]}`, `{"prompt":{}}`, `{}`} {
		if _, err := ContinueBody(openai.Completions, []byte(body), "x", 1); !errors.Is(err, errNotContinuable) {
			t.Errorf("ContinueBody(%s): err = %v, want errNotContinuable", body, err)
		}
	}
	if _, err := ContinueBody(openai.Chat, []byte(`{"messages":[{"role":"assistant","content":[{"type":"text","text":"a"}]}],"continue_final_message":true}`), "x", 1); !errors.Is(err, errNotContinuable) {
		t.Errorf("a final message with content parts: err = %v, want errNotContinuable", err)
	}
}

func TestContinuable(t *testing.T) {
	for _, tc := range []struct {
		endpoint openai.Endpoint
		body     string
		ok       bool
	}{
		{openai.Completions, `{"prompt":"a"}`, true},
		{openai.Completions, `{"prompt":["a"],"n":1}`, true},
		{openai.Chat, `{"messages":[]}`, true},
		{openai.Completions, `{"prompt":[1,2,3]}`, false},
		{openai.Completions, `{"prompt":["a","b"]}`, false},
		{openai.Completions, `{"prompt":"a","echo":true}`, false},
		{openai.Chat, `{"messages":[],"n":2}`, false},
		{openai.Completions, `{"prompt":"a","best_of":3}`, false},
		{openai.Completions, `{"prompt":"a","use_beam_search":true}`, false},
		{openai.Chat, `{"messages":[],"response_format":{"type":"json_object"}}`, false},
		{openai.Chat, `{"messages":[],"response_format":{"type":"text"}}`, true},
		{openai.Chat, `{"messages":[],"guided_json":{"type":"object"}}`, false},
		{openai.Completions, `{"prompt":"a","guided_regex":"[a-z]+"}`, false},
		{openai.Chat, `{"messages":[],"structured_outputs":{"choice":["a","b"]}}`, false},
		{openai.Chat, `{"messages":[],"tools":[],"tool_choice":"required"}`, false},
		{openai.Chat, `{"messages":[],"tools":[],"tool_choice":"auto"}`, true},
	} {
		err := continuable(tc.endpoint, []byte(tc.body))
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, errNotContinuable)) {
			t.Errorf("%s %s: continuable = %v, want ok=%v", tc.endpoint, tc.body, err, tc.ok)
		}
	}
}

func TestTranscript(t *testing.T) {
	var tr transcript
	for _, c := range []string{
		`{"id":"chatcmpl-x","created":111,"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`,
		`{"id":"chatcmpl-x","created":111,"choices":[{"index":0,"delta":{"content":"Hel"}}]}`,
		`{"id":"chatcmpl-x","created":111,"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}`,
	} {
		tr.add([]byte(c))
	}
	tr.read()
	if tr.text.String() != "Hello" || tr.tokens != 2 || tr.created != 111 || tr.finished {
		t.Errorf("transcript %q, %d tokens, created %d, finished %v", tr.text.String(), tr.tokens, tr.created, tr.finished)
	}
	tr.add([]byte(`{"created":111,"choices":[{"text":"!","finish_reason":"length"}]}`))
	tr.read()
	if !tr.finished || tr.text.String() != "Hello!" {
		t.Errorf("after the finish chunk: %q, finished %v", tr.text.String(), tr.finished)
	}
	// The engine's own count, when it sends one, wins.
	tr.add([]byte(`{"created":111,"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}`))
	tr.read()
	if tr.tokens != 4 || tr.opaque {
		t.Errorf("after a usage chunk: %d tokens, opaque %v; want 4, false", tr.tokens, tr.opaque)
	}
	tr.add([]byte(`{"created":111,"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}`))
	tr.read()
	if !tr.opaque {
		t.Error("a tool call delta must make the transcript opaque")
	}
}

func TestContinuationRewrite(t *testing.T) {
	c := &continuation{resume: dispatcher.Resume{Chunks: 4, Tokens: 3, Created: 111}, chat: true}
	for _, tc := range []struct{ in, want string }{
		{`{"id":"chatcmpl-x","object":"chat.completion.chunk","created":999,"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`, ""},
		{`{"id":"chatcmpl-x","object":"chat.completion.chunk","created":999,"model":"m","choices":[{"index":0,"delta":{"content":"\"created\":5"}}]}`,
			`{"id":"chatcmpl-x","object":"chat.completion.chunk","created":111,"model":"m","choices":[{"index":0,"delta":{"content":"\"created\":5"}}]}`},
		{`{"id":"chatcmpl-x","created":999,"choices":[],"usage":{"prompt_tokens":13,"completion_tokens":5,"total_tokens":18}}`,
			`{"id":"chatcmpl-x","created":111,"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":8,"total_tokens":18}}`},
		// only the top-level created and usage change
		{`{"id":"x","choices":[{"index":0,"delta":{"content":"<b>"},"created":5,"usage":null}],"created":999, "usage" : {"prompt_tokens":13, "completion_tokens":5}}`,
			`{"id":"x","choices":[{"index":0,"delta":{"content":"<b>"},"created":5,"usage":null}],"created":111, "usage" : {"prompt_tokens":10, "completion_tokens":8}}`},
		{`{"created":999,"choices":[],"usage":null}`, `{"created":111,"choices":[],"usage":null}`},
		// a second role chunk is content, not the continuation's opening
		{`{"created":999,"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`,
			`{"created":111,"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`},
	} {
		if got := string(c.rewrite([]byte(tc.in))); got != tc.want {
			t.Errorf("rewrite(%s)\n got  %s\n want %s", tc.in, got, tc.want)
		}
	}
	// The per-token path: one copy of the chunk.
	chunk := []byte(`{"id":"chatcmpl-x","object":"chat.completion.chunk","created":999,"model":"m","choices":[{"index":0,"delta":{"content":"lo"}}]}`)
	if n := testing.AllocsPerRun(100, func() { c.rewrite(chunk) }); n > 1 {
		t.Errorf("rewriting a chunk allocates %v times", n)
	}
}

func BenchmarkContinueBody(b *testing.B) {
	body := testbody.Chat(400 << 10)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ContinueBody(openai.Chat, body, "Hello there, <friend>", 20); err != nil {
			b.Fatal(err)
		}
	}
}

// TestTranscriptBounded: a long stream's transcript holds its chunks up to
// maxTranscriptRaw, then only their text, which stays whole; a text past
// maxTranscriptText is no base for a continuation.
func TestTranscriptBounded(t *testing.T) {
	var tr transcript
	const n = 20000 // some 4 MB of chunks, 40 KB of text
	for i := range n {
		tr.add([]byte(`{"id":"cmpl-x","object":"text_completion","created":17,"model":"m","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}` + strings.Repeat(" ", i%3)))
		if tr.rawBytes > maxTranscriptRaw {
			t.Fatalf("after %d chunks the transcript holds %d bytes of them, over %d", i+1, tr.rawBytes, maxTranscriptRaw)
		}
	}
	tr.read()
	if tr.tokens != n || tr.text.Len() != 5*n || tr.created != 17 || tr.tooLong {
		t.Errorf("transcript of %d tokens, %d bytes of text, created %d, too long %v; want %d, %d, 17, false",
			tr.tokens, tr.text.Len(), tr.created, tr.tooLong, n, 5*n)
	}
	long := []byte(`{"choices":[{"index":0,"text":"` + strings.Repeat("x", 64<<10) + `"}]}`)
	for range maxTranscriptText / (64 << 10) {
		tr.add(long)
	}
	tr.read()
	if !tr.tooLong || tr.text.Len() > maxTranscriptText {
		t.Errorf("a transcript of %d bytes of text, too long %v: want it bounded and marked", tr.text.Len(), tr.tooLong)
	}
}
