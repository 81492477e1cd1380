package openai

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
)

func TestDecodeRequest(t *testing.T) {
	for _, tc := range []struct {
		name     string
		endpoint Endpoint
		body     string
		param    string // "" with ok
		ok       bool
		check    func(t *testing.T, r *Request)
	}{
		{name: "chat", endpoint: Chat, ok: true,
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":5,"kv_transfer_params":{"x":[1]}}`,
			check: func(t *testing.T, r *Request) {
				if !r.Stream || !r.IncludeUsage() || *r.MaxTokens != 5 || string(r.KVTransferParams) != `{"x":[1]}` {
					t.Errorf("got %+v", r)
				}
				if n, ok := r.OutputLimit(Chat); !ok || n != 5 {
					t.Errorf("MaxOutputTokens = %d, %v", n, ok)
				}
			}},
		{name: "max_completion_tokens wins", endpoint: Chat, ok: true,
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"max_completion_tokens":2}`,
			check: func(t *testing.T, r *Request) {
				if n, _ := r.OutputLimit(Chat); n != 2 {
					t.Errorf("MaxOutputTokens = %d", n)
				}
			}},
		{name: "content parts", endpoint: Chat, ok: true,
			body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}`,
			check: func(t *testing.T, r *Request) {
				if s, _ := r.Messages[0].Text(); s != "a\nb" {
					t.Errorf("text = %q", s)
				}
			}},
		{name: "image part", endpoint: Chat, ok: true,
			body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"input_audio","input_audio":{"data":"AA","format":"wav"}}]}]}`,
			check: func(t *testing.T, r *Request) {
				if s, _ := r.Messages[0].Text(); s != "what is this?" {
					t.Errorf("text = %q", s)
				}
				parts, _ := r.Messages[0].Parts()
				if len(parts) != 3 || parts[1].Type != "image_url" || !strings.Contains(string(parts[1].Raw), "base64,AAAA") {
					t.Errorf("parts = %+v", parts)
				}
			}},
		{name: "untyped part", endpoint: Chat, param: "messages", body: `{"model":"m","messages":[{"role":"user","content":[{"text":"a"}]}]}`},
		{name: "text part without text", endpoint: Chat, param: "messages", body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`},
		{name: "null content", endpoint: Chat, ok: true, body: `{"model":"m","messages":[{"role":"assistant","content":null}]}`},
		{name: "unknown fields pass", endpoint: Chat, ok: true, body: `{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0.2,"tools":[]}`},
		{name: "completion token ids", endpoint: Completions, ok: true, body: `{"model":"m","prompt":[1,2,3]}`},
		{name: "completion one-element list", endpoint: Completions, ok: true, body: `{"model":"m","prompt":["hello"]}`},
		{name: "completion nested ids", endpoint: Completions, ok: true, body: `{"model":"m","prompt":[[1,2]]}`},
		{name: "no model", endpoint: Chat, param: "model", body: `{"messages":[{"role":"user","content":"x"}]}`},
		{name: "empty messages", endpoint: Chat, param: "messages", body: `{"model":"m","messages":[]}`},
		{name: "messages wrong type", endpoint: Chat, param: "messages", body: `{"model":"m","messages":"hi"}`},
		{name: "content wrong type", endpoint: Chat, param: "messages", body: `{"model":"m","messages":[{"role":"user","content":5}]}`},
		{name: "prompt missing", endpoint: Completions, param: "prompt", body: `{"model":"m"}`},
		{name: "prompt object", endpoint: Completions, param: "prompt", body: `{"model":"m","prompt":{"a":1}}`},
		{name: "prompt batch", endpoint: Completions, ok: true, body: `{"model":"m","prompt":["a","b"]}`},
		{name: "token batch", endpoint: Completions, ok: true, body: `{"model":"m","prompt":[[1,2],[3]]}`},
		{name: "mixed batch", endpoint: Completions, param: "prompt", body: `{"model":"m","prompt":["a",[3]]}`},
		{name: "batch with an empty list", endpoint: Completions, param: "prompt", body: `{"model":"m","prompt":["a",[]]}`},
		{name: "batch with a number", endpoint: Completions, param: "prompt", body: `{"model":"m","prompt":[["a"],1]}`},
		{name: "prompt empty list", endpoint: Completions, param: "prompt", body: `{"model":"m","prompt":[]}`},
		{name: "negative max_tokens", endpoint: Completions, param: "max_tokens", body: `{"model":"m","prompt":"x","max_tokens":-1}`},
		{name: "float max_tokens", endpoint: Completions, param: "max_tokens", body: `{"model":"m","prompt":"x","max_tokens":1.5}`},
		{name: "kv params array", endpoint: Completions, param: "kv_transfer_params", body: `{"model":"m","prompt":"x","kv_transfer_params":[1]}`},
		{name: "two values", endpoint: Completions, body: `{"model":"m","prompt":"x"} {}`},
		{name: "trailing brace", endpoint: Completions, body: `{"model":"m","prompt":"x"}}`},
		{name: "truncated", endpoint: Completions, body: `{"model":"m","prompt":"x"`},
		{name: "not an object", endpoint: Completions, body: `"hi"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, apiErr := DecodeRequest(tc.endpoint, []byte(tc.body))
			if tc.ok {
				if apiErr != nil {
					t.Fatalf("unexpected error %v", apiErr)
				}
				if tc.check != nil {
					tc.check(t, r)
				}
				return
			}
			if apiErr == nil {
				t.Fatal("want an error")
			}
			if apiErr.Code != http.StatusBadRequest || apiErr.Type != "BadRequestError" {
				t.Errorf("error = %+v", apiErr)
			}
			got := ""
			if apiErr.Param != nil {
				got = *apiErr.Param
			}
			if got != tc.param {
				t.Errorf("param = %q, want %q (message %q)", got, tc.param, apiErr.Message)
			}
			if strings.Contains(apiErr.Message, "Go value") || strings.Contains(apiErr.Message, "openai.") {
				t.Errorf("message leaks Go internals: %q", apiErr.Message)
			}
		})
	}
}

func TestParseError(t *testing.T) {
	for _, tc := range []struct {
		body string
		msg  string
		ok   bool
	}{
		{`{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}`, "bad", true},
		{`{"object":"error","message":"old style","type":"BadRequestError","code":400}`, "old style", true},
		{`{"error":"Unauthorized"}`, "Unauthorized", true},
		{`{"detail":"Not Found"}`, "", false},
		{`not json`, "", false},
	} {
		e, ok := ParseError([]byte(tc.body))
		if ok != tc.ok || (ok && e.Message != tc.msg) {
			t.Errorf("ParseError(%s) = %+v, %v", tc.body, e, ok)
		}
	}
}

func TestErrorEnvelope(t *testing.T) {
	e := NewError(http.StatusNotFound, "The model `%s` does not exist.", "x").WithParam("model")
	raw, _ := json.Marshal(ErrorResponse{Error: e})
	want := `{"error":{"message":"The model ` + "`x`" + ` does not exist.","type":"NotFoundError","param":"model","code":404}}`
	if string(raw) != want {
		t.Errorf("envelope = %s\nwant %s", raw, want)
	}
	if (&Error{Code: 0}).Status() != 500 {
		t.Error("a code that is no HTTP status must answer 500")
	}
}

// FuzzDecodeRequest checks that no body makes request parsing panic, and
// that every refusal is a 400 with a message. The seeds run in every
// `go test`; `go test -fuzz FuzzDecodeRequest ./pkg/openai` explores more.
func FuzzDecodeRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","prompt":[[1,2]],"max_tokens":3,"kv_transfer_params":{"do_remote_decode":true}}`,
		`{"model":"m","prompt":["a","b"]}`,
		`{"model":1}`, `[]`, `null`, `{`, ``, `{"messages":[null]}`, `{"model":"m","prompt":[null]}`,
	} {
		f.Add(seed, true)
		f.Add(seed, false)
	}
	f.Fuzz(func(t *testing.T, body string, chat bool) {
		ep := Completions
		if chat {
			ep = Chat
		}
		r, apiErr := DecodeRequest(ep, []byte(body))
		if apiErr != nil {
			if apiErr.Code != http.StatusBadRequest || apiErr.Message == "" {
				t.Fatalf("refusal %+v is not a 400 with a message", apiErr)
			}
			return
		}
		if r.Model == "" {
			t.Fatal("accepted a request without a model")
		}
	})
}

// TestTextBytes checks the quick count of a message's text against the
// length of Text, which decodes it (for text without escapes, which make
// the count an upper bound), and that it refuses what Parts refuses, with
// the same message.
func TestTextBytes(t *testing.T) {
	for _, content := range []string{
		`"hello world"`,
		`""`,
		` "spaced" `,
		`null`,
		`[]`,
		`[{"type":"text","text":"one"}]`,
		`[{"type":"text","text":"one"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"two"}]`,
		`[{"text":"x","type":"text","extra":[1,{"a":"b"}]}]`,
		`[{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]`,
		`[{"type":"text","text":"a","text":"longer"}]`,
		`5`,
		`{"type":"text"}`,
		`[5]`,
		`["text"]`,
		`[{"text":"x"}]`,
		`[{"type":null,"text":"x"}]`,
		`[{"type":"text"}]`,
		`[{"type":"text","text":null}]`,
		`[{"type":"text","text":5}]`,
		`[{"type":7,"text":"x"}]`,
		`[{"type":"image_url","text":5}]`,
		`[null]`,
		`[{"Type":"image_url","image_url":{}}]`,
		`[{"TYPE":"text","text":"x"}]`,
		`[{"type":"text","TEXT":"x"}]`,
		`[{"type":"text","text":"a","Text":5}]`,
		`[{"type":"text","TYPE":"image_url","text":"abc"}]`,
		`[{"type":"image_url","Type":"text","Text":"abc"}]`,
	} {
		m := Message{Role: "user", Content: []byte(content)}
		text, werr := m.Text()
		n, err := m.textBytes()
		switch {
		case (err == nil) != (werr == nil):
			t.Errorf("%s: textBytes error %v, Text error %v", content, err, werr)
		case err != nil && err.Error() != werr.Error():
			t.Errorf("%s: textBytes says %q, Text %q", content, err, werr)
		case err == nil && n != len(text):
			t.Errorf("%s: textBytes %d, want %d", content, n, len(text))
		}
	}
}

// TestOutputLimitOf checks a completions body's limit as vLLM reads it:
// its default when max_tokens is absent (its key matched exactly), none
// for an explicit null.
func TestOutputLimitOf(t *testing.T) {
	for _, tc := range []struct {
		endpoint Endpoint
		body     string
		n        int
		ok       bool
	}{
		{Completions, `{"prompt":"x"}`, DefaultCompletionTokens, true},
		{Completions, `{"prompt":"x","max_tokens":null}`, 0, false},
		{Completions, `{"prompt":"x","Max_Tokens":null}`, DefaultCompletionTokens, true},
		{Completions, `{"prompt":"x","max_tokens":7}`, 7, true},
		{Chat, `{"messages":[],"max_tokens":7,"max_completion_tokens":9}`, 9, true},
		{Chat, `{"messages":[]}`, 0, false},
	} {
		n, ok, err := OutputLimitOf(tc.endpoint, []byte(tc.body))
		if err != nil || n != tc.n || ok != tc.ok {
			t.Errorf("%s %s: %d, %v, %v; want %d, %v", tc.endpoint, tc.body, n, ok, err, tc.n, tc.ok)
		}
	}
}

// TestDecodeFast checks the scanner's reading of a request against
// json.Unmarshal's, and that what it cannot read exactly so is left to
// json.Unmarshal.
func TestDecodeFast(t *testing.T) {
	for _, tc := range []struct {
		body string
		fast bool // decodeFast reads it
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}`, true},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}],"name":"x"},{"role":"assistant","content":null}]}`, true},
		{` { "messages" : [ { "content" : "é\u2028<b>" , "role" : "system" } ] , "model" : "m" } `, true},
		{`{"model":"m","prompt":"once upon","max_tokens":null,"stream_options":{"include_usage":true}}`, true},
		{`{"model":"m","prompt":[1,2,3],"kv_transfer_params":{"a":1}}`, true},
		{`{"model":"m","prompt":null,"messages":null}`, true},
		{`{"model":"m","messages":[]}`, true},
		// Messages twice: encoding/json fills the first list's structs
		// again, and a null role keeps the first one's.
		{`{"model":"m","messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"b"}]}`, false},
		{`{"model":"m","messages":[{"role":"user","content":"a"}],"messages":[{"role":null,"content":"b"}]}`, false},
		{`{"model":"m"}`, true},
		{`{"model":"m","Messages":[{"role":"user","content":"hi"}]}`, false},
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"Messages":null}`, false},
		{`{"model":"m","prompt":"x","PROMPT":null}`, false},
		{`{"model":"m","messages":[{"Role":"user","content":"hi"}]}`, false},
		{`{"model":"m","messages":[{"role":"user"}]}`, false},
		{`{"model":"m","messages":[{"role":"a","content":1,"Role":"b"}]}`, false},
		{`{"model":"m","messages":[{"role":"a","content":1,"role":"b"}]}`, false},
		{`{"model":"m","messages":[{"role":5,"content":"x"}]}`, false},
		{`{"model":"m","messages":"hi"}`, false},
		{`{"model":"m","messages":[5]}`, false},
		{`{"model":"m","stream":"yes","messages":[]}`, false},
		{`{"model":"m"} x`, false},
		{`[1]`, false},
		{`{"model":"m","prompt":"x",}`, false},
	} {
		got, ok := decodeFast([]byte(tc.body))
		if ok != tc.fast {
			t.Errorf("%s: read by the scanner %v, want %v", tc.body, ok, tc.fast)
		}
		if !ok {
			continue
		}
		var want Request
		if err := json.Unmarshal([]byte(tc.body), &want); err != nil {
			t.Errorf("%s: the scanner read what json.Unmarshal refuses: %v", tc.body, err)
			continue
		}
		want.limits = limitsOf([]byte(tc.body))
		if !reflect.DeepEqual(*got, want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.body, *got, want)
		}
	}
}

// FuzzDecodeFast: whatever the scanner reads, json.Unmarshal reads the
// same, and accepts.
func FuzzDecodeFast(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`,
		`{"model":"m","prompt":[1,2],"messages":null,"Prompt":1}`,
		`{"messages":[{"role":"a","content":[{"type":"text","text":"\u00e9"}]}],"n":2}`,
		`{"messages":[{"role":"a","content":1,"Role":"b","CONTENT":2}]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, ok := decodeFast(body)
		if !ok {
			return
		}
		var want Request
		if err := json.Unmarshal(body, &want); err != nil {
			t.Fatalf("%q: the scanner read what json.Unmarshal refuses: %v", body, err)
		}
		want.limits = limitsOf(body)
		if !reflect.DeepEqual(*got, want) {
			t.Fatalf("%q:\n got %+v\nwant %+v", body, *got, want)
		}
	})
}

// limitsOf is what DecodeRequest's slow path keeps of a body's limits.
func limitsOf(body []byte) [2]json.RawMessage {
	l, err := jsonobj.Lookup(body, "max_tokens", "max_completion_tokens")
	if err != nil {
		return [2]json.RawMessage{}
	}
	return [2]json.RawMessage{l[0], l[1]}
}
