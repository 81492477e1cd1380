package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// reply is an HTTP answer.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// call sends body (a string as is, anything else as JSON) with headers
// given as name, value pairs.
func call(t *testing.T, method, url string, body any, headers ...string) reply {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		raw, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(raw)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: raw}
}

func (r reply) want(t *testing.T, status int) reply {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d; body: %s", r.status, status, r.body)
	}
	return r
}

func (r reply) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decode %s: %v", r.body, err)
	}
}

// apiError checks an error envelope: its code is the status, its message
// holds msg.
func (r reply) apiError(t *testing.T, status int, msg string) *openai.Error {
	t.Helper()
	r.want(t, status)
	e, ok := openai.ParseError(r.body)
	if !ok {
		t.Fatalf("not an error envelope: %s", r.body)
	}
	if e.Code != status || !strings.Contains(e.Message, msg) {
		t.Errorf("error = %+v; want code %d and a message with %q", e, status, msg)
	}
	return e
}

func completion(t *testing.T, e *simtest.Engine, body any, headers ...string) openai.Completion {
	t.Helper()
	var c openai.Completion
	call(t, http.MethodPost, e.URL+"/v1/completions", body, headers...).want(t, http.StatusOK).decode(t, &c)
	return c
}

func chat(t *testing.T, e *simtest.Engine, body any, headers ...string) openai.ChatCompletion {
	t.Helper()
	var c openai.ChatCompletion
	call(t, http.MethodPost, e.URL+"/v1/chat/completions", body, headers...).want(t, http.StatusOK).decode(t, &c)
	return c
}

// events splits an SSE body into its data payloads, [DONE] included.
func events(t *testing.T, raw []byte) []string {
	t.Helper()
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(string(raw), "\n\n"), "\n\n") {
		if !strings.HasPrefix(ev, "data: ") {
			t.Fatalf("bad event %q in %s", ev, raw)
		}
		out = append(out, strings.TrimPrefix(ev, "data: "))
	}
	return out
}

// prefillParams is the kv_transfer_params skeleton a router sends to P.
var prefillParams = map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
	"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}

func fast(mutate func(*simconfig.Config)) simconfig.Config {
	c := simtest.FastConfig()
	if mutate != nil {
		mutate(&c)
	}
	return c
}

func user(content any) []any {
	return []any{map[string]any{"role": "user", "content": content}}
}
