package gateway

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

func TestRequestID(t *testing.T) {
	for _, tc := range []struct {
		header string
		ok     bool
		kept   bool // the key is the header itself
	}{
		{"abc-123_X", true, true}, {strings.Repeat("a", 124), true, true},
		// Any printable ASCII id up to 256 bytes, as vLLM takes any: the
		// ones that are no subject token run under a key made from them.
		{"a.b", true, false}, {"a*", true, false}, {"a>", true, false}, {"a b", true, false},
		{"req.1:abc", true, false}, {"pdq.reply.x.>", true, false}, {strings.Repeat("a", 256), true, false},
		{"a\tb", false, false}, {"\u00fc", false, false}, {strings.Repeat("a", 257), false, false}, {"a\x7f", false, false},
	} {
		clientID, key, err := requestID(tc.header)
		if !tc.ok {
			if err == nil || err.Code != http.StatusBadRequest || !strings.Contains(err.Message, "X-Request-Id") {
				t.Errorf("requestID(%q) accepted, got %q, %q", tc.header, clientID, key)
			}
			continue
		}
		want, _ := dispatcher.RequestKey(tc.header)
		if err != nil || clientID != tc.header || key != want || (key == tc.header) != tc.kept {
			t.Errorf("requestID(%q) = %q, %q, %v; want the header and key %q", tc.header, clientID, key, err, want)
		}
	}
	a, ak, _ := requestID("")
	b, _, _ := requestID("")
	if a == b || a != ak || len(a) != 36 || !dispatcher.ValidRequestID(a) || a[14] != '4' {
		t.Errorf("generated ids %q, %q are not fresh v4 UUIDs", a, b)
	}
}

func TestResponseIDs(t *testing.T) {
	if ids := newResponseIDs(openai.Chat, "same", "same"); ids != nil || string(ids.apply([]byte(`{"id":"x"}`))) != `{"id":"x"}` {
		t.Errorf("an id that is its own key: %+v", ids)
	}
	ids := newResponseIDs(openai.Completions, `a "b".c`, "pdqid_k")
	for in, want := range map[string]string{
		`{"id":"cmpl-pdqid_k","choices":[{"text":" x"}]}`: `{"id":"cmpl-a \"b\".c","choices":[{"text":" x"}]}`,
		`{"choices":[],"id": "cmpl-pdqid_k" }`:            `{"choices":[],"id": "cmpl-a \"b\".c" }`,
		`{"id":"cmpl-other"}`:                             `{"id":"cmpl-other"}`,
		`{"error":{"message":"x"}}`:                       `{"error":{"message":"x"}}`,
		`not json`:                                        `not json`,
	} {
		if got := string(ids.apply([]byte(in))); got != want {
			t.Errorf("apply(%s) = %s, want %s", in, got, want)
		}
	}
}

func TestDefaultModel(t *testing.T) {
	one := map[string]json.RawMessage{"m": nil}
	for in, want := range map[string]string{
		`{"messages":[], "max_tokens":1}`: `{"messages":[], "max_tokens":1,"model":"m"}`,
		`{"model": null, "prompt":"x"}`:   `{"model": "m", "prompt":"x"}`,
		`{ "prompt":"x", "model":"" }`:    `{ "prompt":"x", "model":"m" }`,
		`{"model":"other","prompt":"x"}`:  `{"model":"other","prompt":"x"}`,
		`{"model":5,"prompt":"x"}`:        `{"model":5,"prompt":"x"}`, // DecodeRequest refuses it
		`{"Model":"other","prompt":"x"}`:  `{"Model":"other","prompt":"x","model":"m"}`,
		`{"model": "x"`:                   `{"model": "x"`, // malformed: DecodeRequest words it
		`[]`:                              `[]`,
	} {
		got, filled, err := defaultModel([]byte(in), one)
		if err != nil || string(got) != want || filled != (in != want) {
			t.Errorf("defaultModel(%s) = %s, %v, %v; want %s", in, got, filled, err, want)
		}
	}
	_, _, err := defaultModel([]byte(`{"prompt":"x"}`), map[string]json.RawMessage{"b": nil, "a": nil})
	if err == nil || err.Code != http.StatusBadRequest || err.Param == nil || *err.Param != "model" ||
		!strings.Contains(err.Message, "pdq serves 2 models: `a`, `b`") {
		t.Errorf("several models: %+v", err)
	}
	if _, _, err := defaultModel([]byte(`{"prompt":"x"}`), nil); err == nil || err.Code != http.StatusNotFound {
		t.Errorf("no model: %+v", err)
	}
}

func TestCardAt(t *testing.T) {
	card := `{"id":"m","object":"model","created":17,"owned_by":"vllm","permission":[{"id":"modelperm-1","created":17,"allow_view":true},{"created":3}],"max_model_len":8}`
	want := `{"id":"m","object":"model","created":1000,"owned_by":"vllm","permission":[{"id":"modelperm-1","created":1000,"allow_view":true},{"created":1000}],"max_model_len":8}`
	if got := string(cardAt(json.RawMessage(card), 1000)); got != want {
		t.Errorf("cardAt:\n got %s\nwant %s", got, want)
	}
	for _, card := range []string{`{"id":"m"}`, `{"id":"m","permission":[]}`, `null`, `{"created":1,"permission":"x"}`} {
		got := string(cardAt(json.RawMessage(card), 1000))
		if want := strings.Replace(card, `"created":1,`, `"created":1000,`, 1); got != want {
			t.Errorf("cardAt(%s) = %s, want %s", card, got, want)
		}
	}
}

func TestParseRequest(t *testing.T) {
	t.Run("client kv_transfer_params are dropped in any case", func(t *testing.T) {
		body := `{"model":"m","prompt":"x","KV_Transfer_Params":{"remote_host":"evil"},"kv_transfer_params":{"do_remote_prefill":true}}`
		in, err := parseRequest(openai.Completions, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if !in.droppedKV || strings.Contains(strings.ToLower(string(in.body)), "kv_transfer") || strings.Contains(string(in.body), "evil") {
			t.Errorf("body = %s", in.body)
		}
		var m map[string]any
		json.Unmarshal(in.body, &m)
		if m["model"] != "m" || m["prompt"] != "x" {
			t.Errorf("other fields lost: %s", in.body)
		}
	})
	t.Run("dropping the params keeps the other members' bytes", func(t *testing.T) {
		for _, tc := range []struct{ in, want string }{
			{`{"kv_transfer_params":{"a":1},"prompt":"<a>&amp;\u2028","model":"m","z":[1, 2]}`, `{"prompt":"<a>&amp;\u2028","model":"m","z":[1, 2]}`},
			{`{"prompt":"<b>" , "kv_transfer_params":null , "model":"m"}`, `{"prompt":"<b>" , "model":"m"}`},
			{`{"model":"m","prompt":"x","KV_TRANSFER_PARAMS":{}}`, `{"model":"m","prompt":"x"}`},
		} {
			in, err := parseRequest(openai.Completions, []byte(tc.in))
			if err != nil || string(in.body) != tc.want || !in.droppedKV {
				t.Errorf("%s: body = %s, %v; want %s", tc.in, in.body, err, tc.want)
			}
		}
	})
	t.Run("a body without params passes byte for byte", func(t *testing.T) {
		body := `{"prompt":"x",  "model":"m", "temperature":0.50}`
		in, err := parseRequest(openai.Completions, []byte(body))
		if err != nil || string(in.body) != body || in.droppedKV {
			t.Errorf("body = %s, %v", in.body, err)
		}
	})
	t.Run("prompt estimates", func(t *testing.T) {
		for _, tc := range []struct {
			ep   openai.Endpoint
			body string
			want int
		}{
			{openai.Completions, `{"model":"m","prompt":"12345678"}`, 2},
			{openai.Completions, `{"model":"m","prompt":[1,2,3,4,5]}`, 5},
			{openai.Chat, `{"model":"m","messages":[{"role":"system","content":"1234"},{"role":"user","content":"12345"}]}`, 3},
		} {
			in, err := parseRequest(tc.ep, []byte(tc.body))
			if err != nil || in.promptTokens != tc.want {
				t.Errorf("%s: estimate %d, %v; want %d", tc.body, in.promptTokens, err, tc.want)
			}
		}
	})
}

// FuzzParseRequest checks that no body makes the gateway's parsing panic,
// that every refusal is a 400, and that no accepted body keeps a
// kv_transfer_params for the engines. The seeds run in every `go test`.
func FuzzParseRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`,
		`{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.1"}}`,
		`{"model":"m","prompt":[1,2],"KV_TRANSFER_PARAMS":null}`,
		`{"model":"m","prompt":"x","kv_transfer_params":1}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"max_tokens":"1"}`,
		`{"model":"","prompt":"x"}`, `{}`, `[]`, `{"model":"m","prompt":"x"}{}`, "\x00", ``,
	} {
		f.Add(seed, true)
		f.Add(seed, false)
	}
	f.Fuzz(func(t *testing.T, body string, chat bool) {
		ep := openai.Completions
		if chat {
			ep = openai.Chat
		}
		in, apiErr := parseRequest(ep, []byte(body))
		if apiErr != nil {
			if apiErr.Code != http.StatusBadRequest || apiErr.Message == "" {
				t.Fatalf("refusal %+v is not a 400 with a message", apiErr)
			}
			return
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(in.body, &m); err != nil {
			t.Fatalf("accepted body %q is no JSON object: %v", in.body, err)
		}
		for k := range m {
			if strings.EqualFold(k, "kv_transfer_params") {
				t.Fatalf("kv_transfer_params survived in %s", in.body)
			}
		}
		if in.promptTokens < 0 {
			t.Fatalf("negative prompt estimate %d", in.promptTokens)
		}
	})
}

func TestCheckLength(t *testing.T) {
	ids := func(n int) string { return "[" + strings.TrimSuffix(strings.Repeat("1,", n), ",") + "]" }
	for _, tc := range []struct {
		name     string
		endpoint openai.Endpoint
		body     string
		want     string // a part of the refusal; "" for none
	}{
		{"chat within", openai.Chat, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":99}`, ""},
		{"chat max_tokens", openai.Chat, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":100}`, "too large: 100. This model's maximum context length is 100 tokens and your request has at least 1 input tokens (100 > 100 - 1)"},
		{"chat max_completion_tokens wins", openai.Chat, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":100}`, "too large: 100"},
		{"chat without a limit", openai.Chat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`, ""},
		{"completions ignore max_completion_tokens", openai.Completions, `{"model":"m","prompt":[1,2,3],"max_tokens":10,"max_completion_tokens":100000}`, ""},
		{"completions token prompt", openai.Completions, `{"model":"m","prompt":` + ids(90) + `,"max_tokens":11}`, "your request has 90 input tokens (11 > 100 - 90)"},
		{"completions default 16", openai.Completions, `{"model":"m","prompt":` + ids(90) + `}`, "too large: 16"},
		{"completions max_tokens null: no limit", openai.Completions, `{"model":"m","prompt":` + ids(90) + `,"max_tokens":null}`, ""},
		{"completions max_completion_tokens 0 ignored", openai.Completions, `{"model":"m","prompt":[1],"max_completion_tokens":0}`, ""},
		{"completions prompt too long", openai.Completions, `{"model":"m","prompt":` + ids(100) + `,"max_tokens":1}`, "your request has 100 input tokens. Please"},
		{"batch: the longest prompt counts", openai.Completions, `{"model":"m","prompt":[[1],` + ids(95) + `],"max_tokens":10}`, "(10 > 100 - 95)"},
		{"truncated prompt fits", openai.Completions, `{"model":"m","prompt":` + ids(300) + `,"truncate_prompt_tokens":50,"max_tokens":10}`, ""},
		{"truncated to fit", openai.Completions, `{"model":"m","prompt":` + ids(300) + `,"truncate_prompt_tokens":-1,"max_tokens":10}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, apiErr := openai.DecodeRequest(tc.endpoint, []byte(tc.body))
			if apiErr != nil {
				t.Fatal(apiErr)
			}
			got := checkLength(tc.endpoint, req, 100)
			switch {
			case tc.want == "" && got != nil:
				t.Errorf("refused: %s", got.Message)
			case tc.want != "" && (got == nil || !strings.Contains(got.Message, tc.want) || got.Status() != 400):
				t.Errorf("got %v, want a 400 saying %q", got, tc.want)
			}
		})
	}
	if checkLength(openai.Chat, &openai.Request{MaxTokens: new(int)}, 0) != nil {
		t.Error("refused with no known context length")
	}
}
