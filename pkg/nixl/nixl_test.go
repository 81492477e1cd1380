package nixl

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"testing"

	"github.com/pdq-dev/pdq/internal/testbody"
)

// asMap decodes a JSON object for comparison.
func asMap(t *testing.T, raw []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("%s: %v", raw, err)
	}
	return m
}

func TestPrefillBody(t *testing.T) {
	skeleton := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	for _, tc := range []struct {
		name   string
		client string
		want   map[string]any
	}{
		{"chat streaming with usage and min_tokens",
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"min_tokens":5,"temperature":0.7}`,
			map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "stream": false,
				"max_tokens": 1.0, "temperature": 0.7, "kv_transfer_params": skeleton}},
		{"max_completion_tokens set to 1 too",
			`{"model":"m","prompt":"x","max_completion_tokens":9,"min_completion_tokens":2}`,
			map[string]any{"model": "m", "prompt": "x", "stream": false, "max_tokens": 1.0, "max_completion_tokens": 1.0, "kv_transfer_params": skeleton}},
		{"no limits at all",
			`{"model":"m","prompt":"x"}`,
			map[string]any{"model": "m", "prompt": "x", "stream": false, "max_tokens": 1.0, "kv_transfer_params": skeleton}},
		{"client params are replaced",
			`{"model":"m","prompt":"x","kv_transfer_params":{"remote_host":"evil"}}`,
			map[string]any{"model": "m", "prompt": "x", "stream": false, "max_tokens": 1.0, "kv_transfer_params": skeleton}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := PrefillBody(json.RawMessage(tc.client))
			if err != nil {
				t.Fatal(err)
			}
			if got := asMap(t, out); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("PrefillBody:\n got %v\nwant %v", got, tc.want)
			}
		})
	}
	for _, bad := range []string{`[]`, `null`, `"x"`, `{`} {
		if _, err := PrefillBody(json.RawMessage(bad)); err == nil {
			t.Errorf("PrefillBody(%s) accepted a body that is no object", bad)
		}
	}
}

func TestDecodeBody(t *testing.T) {
	client := json.RawMessage(`{"model":"m","prompt":"x","stream":true,"max_tokens":7}`)
	out, err := DecodeBody(client, nil)
	if err != nil || string(out) != string(client) {
		t.Errorf("decode-only body = %s, %v; want the client's bytes", out, err)
	}
	params := json.RawMessage(`{"remote_block_ids":[[1,2],[3]],"remote_engine_id":"e","x_future_key":{"a":1}}`)
	out, err = DecodeBody(client, params)
	if err != nil {
		t.Fatal(err)
	}
	m := asMap(t, out)
	if m["stream"] != true || m["max_tokens"] != 7.0 || m["prompt"] != "x" {
		t.Errorf("the client's fields changed: %v", m)
	}
	var got struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	json.Unmarshal(out, &got)
	if string(got.KV) != string(params) {
		t.Errorf("params = %s, want them byte for byte: %s", got.KV, params)
	}
}

func TestExtractKVParams(t *testing.T) {
	for _, tc := range []struct {
		body    string
		want    string
		wantErr error
	}{
		// llm-d's simulator: strings where vLLM has lists, no remote_request_id;
		// passed through untouched.
		{`{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":["DUMMY_ID"],"remote_engine_id":"DUMMY_ID","remote_port":1234}}`,
			`{"do_remote_prefill":true,"remote_block_ids":["DUMMY_ID"],"remote_engine_id":"DUMMY_ID","remote_port":1234}`, nil},
		{`{"kv_transfer_params":{"do_remote_prefill": true ,"remote_block_ids":[[1,2],[3]],"remote_engine_id":"e"}}`,
			`{"do_remote_prefill": true ,"remote_block_ids":[[1,2],[3]],"remote_engine_id":"e"}`, nil},
		{`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":"b","remote_engine_id":7}}`,
			`{"do_remote_prefill":true,"remote_block_ids":"b","remote_engine_id":7}`, nil},
		// Issue 7: an empty object is a silent recompute.
		{`{"kv_transfer_params":{}}`, "", ErrIncompleteKVParams},
		{`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e"}}`, "", ErrIncompleteKVParams},
		{`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[]}}`, "", ErrIncompleteKVParams},
		{`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":null,"remote_block_ids":[1]}}`, "", ErrIncompleteKVParams},
		{`{"kv_transfer_params":{"do_remote_prefill":false,"remote_engine_id":"e","remote_block_ids":[1]}}`, "", ErrIncompleteKVParams},
		{`{"kv_transfer_params":{"do_remote_prefill":"true","remote_engine_id":"e","remote_block_ids":[1]}}`, "", ErrIncompleteKVParams},
		{`{"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`, "", ErrIncompleteKVParams},
		{`{"id":"x","kv_transfer_params":null}`, "", ErrNoKVParams},
		{`{"id":"x"}`, "", ErrNoKVParams},
		{`{"kv_transfer_params":[1]}`, "", ErrNoKVParams},
		{`{"kv_transfer_params":"x"}`, "", ErrNoKVParams},
		{`not json`, "", nil},
	} {
		got, err := ExtractKVParams([]byte(tc.body))
		switch {
		case tc.want != "":
			if err != nil || string(got) != tc.want {
				t.Errorf("%s: got %s, %v", tc.body, got, err)
			}
		case tc.wantErr != nil:
			if !errors.Is(err, tc.wantErr) {
				t.Errorf("%s: err = %v, want %v", tc.body, err, tc.wantErr)
			}
		default:
			if err == nil {
				t.Errorf("%s: want an error", tc.body)
			}
		}
	}
}

func TestFixRemoteHost(t *testing.T) {
	for _, tc := range []struct {
		name     string
		params   string
		host     string
		want     string // "" = unchanged
		rewrites bool
	}{
		{"localhost", `{"remote_host":"localhost","remote_port":5600}`, "10.0.0.5", "10.0.0.5", true},
		{"loopback v4", `{"remote_host":"127.0.0.1"}`, "p1.svc", "p1.svc", true},
		{"loopback v6", `{"remote_host":"::1"}`, "10.0.0.5", "10.0.0.5", true},
		{"unspecified", `{"remote_host":"0.0.0.0"}`, "10.0.0.5", "10.0.0.5", true},
		{"null", `{"remote_host":null}`, "10.0.0.5", "10.0.0.5", true},
		{"missing", `{"remote_port":1}`, "10.0.0.5", "10.0.0.5", true},
		{"routable stays", `{"remote_host":"10.1.2.3"}`, "10.0.0.5", "", false},
		{"no host known", `{"remote_host":"localhost"}`, "", "", false},
		{"local replacement is no better", `{"remote_host":"localhost"}`, "127.0.0.1", "", false},
		{"not a string", `{"remote_host":5}`, "10.0.0.5", "", false},
		{"not an object", `[1]`, "10.0.0.5", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, ok := FixRemoteHost(json.RawMessage(tc.params), tc.host)
			if ok != tc.rewrites {
				t.Fatalf("rewrote = %v, want %v (%s)", ok, tc.rewrites, out)
			}
			if !ok {
				if string(out) != tc.params {
					t.Errorf("unchanged params came back as %s", out)
				}
				return
			}
			m := asMap(t, out)
			if m["remote_host"] != tc.want {
				t.Errorf("remote_host = %v, want %s", m["remote_host"], tc.want)
			}
			in := asMap(t, []byte(tc.params))
			for k, v := range in {
				if k != "remote_host" && !reflect.DeepEqual(m[k], v) {
					t.Errorf("%s changed from %v to %v", k, v, m[k])
				}
			}
		})
	}
}

// The engines get the client's bytes: only the P/D fields change, in
// place or appended, and nothing is re-encoded, sorted or HTML-escaped.
func TestBodiesKeepClientBytes(t *testing.T) {
	const client = `{ "model": "m",
  "messages": [{"role":"user","content":"<b>\u00e9 & \"q\"</b> 漢字"}],
  "temperature": 0.70, "stream": true, "stream_options": {"include_usage":true}, "max_tokens": 1e2, "zzz": null }`
	const params = `{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1,2],"remote_host":"10.0.0.1"}`
	skeleton := PrefillParams
	for _, tc := range []struct {
		name string
		fn   func([]byte) ([]byte, error)
		want string
	}{
		{"prefill", func(b []byte) ([]byte, error) { return PrefillBody(b) },
			`{ "model": "m",
  "messages": [{"role":"user","content":"<b>\u00e9 & \"q\"</b> 漢字"}],
  "temperature": 0.70, "stream": false, "max_tokens": 1, "zzz": null,"kv_transfer_params":` + skeleton + ` }`},
		{"decode", func(b []byte) ([]byte, error) { return DecodeBody(b, json.RawMessage(params)) },
			`{ "model": "m",
  "messages": [{"role":"user","content":"<b>\u00e9 & \"q\"</b> 漢字"}],
  "temperature": 0.70, "stream": true, "stream_options": {"include_usage":true}, "max_tokens": 1e2, "zzz": null,"kv_transfer_params":` + params + ` }`},
		{"release", func(b []byte) ([]byte, error) { return ReleaseBody(b, json.RawMessage(params)) },
			`{ "model": "m",
  "messages": [{"role":"user","content":"<b>\u00e9 & \"q\"</b> 漢字"}],
  "temperature": 0.70, "stream": true, "max_tokens": 1, "zzz": null,"kv_transfer_params":` + params + ` }`},
		{"one response, as a replay's decode sends it", func(b []byte) ([]byte, error) {
			parts, err := DecodeParts(b, nil, true)
			return bytes.Join(parts, nil), err
		},
			`{ "model": "m",
  "messages": [{"role":"user","content":"<b>\u00e9 & \"q\"</b> 漢字"}],
  "temperature": 0.70, "stream": false, "max_tokens": 1e2, "zzz": null }`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := tc.fn([]byte(client))
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tc.want {
				t.Errorf("got\n%s\nwant\n%s", out, tc.want)
			}
		})
	}
}

func TestPrefillBodyInPlace(t *testing.T) {
	// Fields the client sent keep their places; a client's params are
	// replaced where they were, duplicates and all.
	client := `{"kv_transfer_params":{"remote_host":"evil"},"max_completion_tokens":9,"prompt":"<x>","stream":true,"max_tokens":5,"kv_transfer_params":{"x":1}}`
	want := `{"kv_transfer_params":` + PrefillParams + `,"max_completion_tokens":1,"prompt":"<x>","stream":false,"max_tokens":1}`
	out, err := PrefillBody(json.RawMessage(client))
	if err != nil || string(out) != want {
		t.Errorf("PrefillBody = %s, %v\nwant %s", out, err, want)
	}
	// Escaped keys are the same keys to vLLM.
	out, err = PrefillBody(json.RawMessage(`{"prompt":"x","str\u0065am":true,"stream\u005foptions":{}}`))
	if err != nil || string(out) != `{"prompt":"x","str\u0065am":false,"kv_transfer_params":`+PrefillParams+`,"max_tokens":1}` {
		t.Errorf("PrefillBody with escaped keys = %s, %v", out, err)
	}
}

func TestFixRemoteHostKeepsBytes(t *testing.T) {
	out, ok := FixRemoteHost(json.RawMessage(`{"remote_port":5600, "remote_host": "localhost" ,"x":"<y>","remote_block_ids":[[1]]}`), "p-1.svc")
	if want := `{"remote_port":5600, "remote_host": "p-1.svc" ,"x":"<y>","remote_block_ids":[[1]]}`; !ok || string(out) != want {
		t.Errorf("FixRemoteHost = %s, %v; want %s", out, ok, want)
	}
}

// A large prompt is copied once: the body's edit allocates its output and
// nothing else.
func TestPrefillBodyAllocs(t *testing.T) {
	body := testbody.Chat(400 << 10)
	var out []byte
	allocs := testing.AllocsPerRun(10, func() {
		var err error
		if out, err = PrefillBody(body); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 1 || cap(out) > len(body)+1024 {
		t.Errorf("PrefillBody of %d bytes: %v allocations, output capacity %d", len(body), allocs, cap(out))
	}
}

func BenchmarkPrefillBody(b *testing.B) {
	for _, size := range []int{1 << 10, 400 << 10} {
		body := testbody.Chat(size)
		b.Run(fmt.Sprintf("%dKB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := PrefillBody(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// leg is how a worker builds one leg's body: as the pieces it sends, and
// as one buffer (PrefillBody, DecodeBody).
type leg struct {
	name  string
	parts func() ([][]byte, error)
	whole func() ([]byte, error)
}

// legs are the prefill and decode legs of body, the decode's with
// handoff params.
func legs(body []byte) []leg {
	params := json.RawMessage(`{"remote_engine_id":"e","remote_block_ids":[1,2],"do_remote_prefill":true}`)
	return []leg{
		{"prefill", func() ([][]byte, error) { return PrefillParts(body) }, func() ([]byte, error) { return PrefillBody(body) }},
		{"decode", func() ([][]byte, error) { return DecodeParts(body, params, false) }, func() ([]byte, error) { return DecodeBody(body, params) }},
	}
}

// The worker sends a large prompt's legs as pieces: the prompt is not
// copied at all, and the pieces join to PrefillBody's and DecodeBody's
// bytes.
func TestBodyPartsDoNotCopy(t *testing.T) {
	body := testbody.Chat(400 << 10)
	for _, tc := range legs(body) {
		var parts [][]byte
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const runs = 20
		for range runs {
			var err error
			if parts, err = tc.parts(); err != nil {
				t.Fatal(err)
			}
		}
		runtime.ReadMemStats(&after)
		bytesPerRun := (after.TotalAlloc - before.TotalAlloc) / runs
		if bytesPerRun > 4096 {
			t.Errorf("%s: %d bytes allocated for the pieces of a %d-byte body", tc.name, bytesPerRun, len(body))
		}
		whole, err := tc.whole()
		if err != nil || !bytes.Equal(bytes.Join(parts, nil), whole) {
			t.Errorf("%s: the pieces join to %.80q, want %.80q (%v)", tc.name, bytes.Join(parts, nil), whole, err)
		}
	}
}

// A short body's legs go out in one piece, which the HTTP transport
// writes with the headers; only a long one is sent as pieces.
func TestShortBodyOnePiece(t *testing.T) {
	for _, size := range []struct {
		bytes int
		one   bool // in one piece
	}{{1 << 10, true}, {60 << 10, true}, {400 << 10, false}} {
		body := testbody.Chat(size.bytes)
		for _, tc := range legs(body) {
			parts, err := tc.parts()
			whole, werr := tc.whole()
			if err != nil || werr != nil || !bytes.Equal(bytes.Join(parts, nil), whole) {
				t.Fatalf("%s of %d bytes: the pieces differ from the body (%v, %v)", tc.name, len(body), err, werr)
			}
			if size.one != (len(parts) == 1) {
				t.Errorf("%s of %d bytes: %d pieces", tc.name, len(body), len(parts))
			}
		}
	}
}
