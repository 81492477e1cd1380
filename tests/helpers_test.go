// Package tests holds pdq's end-to-end tests: real components over real
// loopback HTTP and real side channels, with simulated engines.
package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// testTimeout bounds every request a test makes, so a hang fails the test
// instead of stalling the suite.
const testTimeout = 20 * time.Second

// body is a request body a test builds and edits.
type body map[string]any

func chatBody(model, prompt string, extra body) body {
	b := body{"model": model, "messages": []any{map[string]any{"role": "user", "content": prompt}}}
	for k, v := range extra {
		b[k] = v
	}
	return b
}

func completionBody(model, prompt string, extra body) body {
	b := body{"model": model, "prompt": prompt}
	for k, v := range extra {
		b[k] = v
	}
	return b
}

func (b body) clone() body {
	raw, _ := json.Marshal(b)
	var c body
	json.Unmarshal(raw, &c)
	return c
}

// response is a finished HTTP exchange.
type response struct {
	status int
	header http.Header
	body   []byte
}

// post sends b as JSON, with X-Request-Id when id is not empty.
func post(t *testing.T, url, id string, b any) response {
	t.Helper()
	r, err := tryPost(url, id, b)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func get(t *testing.T, url string) response {
	t.Helper()
	return do(t, http.MethodGet, url, nil, nil)
}

// do sends one request (b as JSON unless it is a string or bytes) and
// reads the whole response.
func do(t *testing.T, method, url string, h http.Header, b any) response {
	t.Helper()
	r, err := tryDo(method, url, h, b)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// tryDo is do for goroutines, which must not call t.Fatal.
func tryDo(method, url string, h http.Header, b any) (response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, err := newRequest(ctx, method, url, b)
	if err != nil {
		return response{}, err
	}
	for k, v := range h {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return response{}, fmt.Errorf("%s %s: %w", method, url, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, fmt.Errorf("%s %s: read body: %w", method, url, err)
	}
	return response{status: resp.StatusCode, header: resp.Header, body: raw}, nil
}

// tryPost is post for goroutines.
func tryPost(url, id string, b any) (response, error) {
	h := http.Header{}
	if id != "" {
		h.Set("X-Request-Id", id)
	}
	return tryDo(http.MethodPost, url, h, b)
}

// send posts b and returns the response unread, for tests that read it as
// it comes or walk away from it.
func send(ctx context.Context, url, id string, b any) (*http.Response, error) {
	req, err := newRequest(ctx, http.MethodPost, url, b)
	if err != nil {
		return nil, err
	}
	if id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	return http.DefaultClient.Do(req)
}

func newRequest(ctx context.Context, method, url string, b any) (*http.Request, error) {
	var raw []byte
	switch v := b.(type) {
	case nil:
	case []byte:
		raw = v
	case string:
		raw = []byte(v)
	default:
		var err error
		if raw, err = json.Marshal(v); err != nil {
			return nil, err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(raw))
	if err != nil {
		return nil, err
	}
	if b != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// decode unmarshals the body into v, failing the test on bad JSON.
func (r response) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("response body %q: %v", r.body, err)
	}
}

// wantStatus fails the test unless the status is want.
func (r response) wantStatus(t *testing.T, want int) {
	t.Helper()
	if r.status != want {
		t.Fatalf("status = %d, want %d; body: %s", r.status, want, r.body)
	}
}

// apiError reads the OpenAI error envelope of a failed response.
func (r response) apiError(t *testing.T) *openai.Error {
	t.Helper()
	var env struct {
		Error *openai.Error `json:"error"`
	}
	r.decode(t, &env)
	if env.Error == nil || env.Error.Message == "" {
		t.Fatalf("body %s is not an error envelope", r.body)
	}
	return env.Error
}

// stream is a streamed response read to its end.
type stream struct {
	status int
	header http.Header
	events [][]byte // data of each event before [DONE]
	done   bool     // [DONE] came last
	err    error    // how reading ended, nil on a clean end
}

// postStream sends b and reads the SSE response to its end.
func postStream(t *testing.T, url, id string, b any) stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := send(ctx, url, id, b)
	if err != nil {
		return stream{err: err}
	}
	defer resp.Body.Close()
	s := stream{status: resp.StatusCode, header: resp.Header}
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		s.events = [][]byte{raw}
		return s
	}
	r := openai.NewSSEReader(resp.Body)
	for {
		ev, err := r.Next()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				s.err = err
			}
			return s
		}
		if s.done {
			s.err = errors.New("event after [DONE]")
			return s
		}
		if ev.IsDone() {
			s.done = true
			continue
		}
		s.events = append(s.events, ev.Data)
	}
}

// chunk is the union of chat and completion chunks that tests read.
type chunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Choices []struct {
		Index int `json:"index"`
		Delta *struct {
			Role    *string `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		Text         *string         `json:"text"`
		FinishReason *string         `json:"finish_reason"`
		StopReason   json.RawMessage `json:"stop_reason"`
	} `json:"choices"`
	Usage *openai.Usage `json:"usage"`
	Error *openai.Error `json:"error"`
}

// result is what a client makes of a response, streamed or not.
type result struct {
	id     string
	text   string
	finish string
	usage  openai.Usage
}

// checkStream checks the SSE framing of a finished stream and assembles it.
// For chat the first event must carry the role and empty content; every
// event must share one id; finish_reason must come on the last token only;
// a usage chunk with no choices comes last when withUsage.
func checkStream(s stream, endpoint openai.Endpoint, withUsage bool) (result, error) {
	if s.err != nil || s.status != http.StatusOK || !s.done {
		return result{}, fmt.Errorf("stream: status %d, done %v, err %v, events %q", s.status, s.done, s.err, s.events)
	}
	var res result
	tokens := 0
	for i, raw := range s.events {
		var c chunk
		if err := json.Unmarshal(raw, &c); err != nil {
			return result{}, fmt.Errorf("event %d %q: %v", i, raw, err)
		}
		if c.Error != nil {
			return result{}, fmt.Errorf("in-stream error: %+v", c.Error)
		}
		if i == 0 {
			res.id = c.ID
		} else if c.ID != res.id {
			return result{}, fmt.Errorf("event %d id %q != first id %q", i, c.ID, res.id)
		}
		wantObject := openai.ObjectTextCompletion
		if endpoint == openai.Chat {
			wantObject = openai.ObjectChatCompletionChunk
		}
		if c.Object != wantObject {
			return result{}, fmt.Errorf("event %d object %q, want %q", i, c.Object, wantObject)
		}
		if len(c.Choices) == 0 {
			if !withUsage || i != len(s.events)-1 || c.Usage == nil {
				return result{}, fmt.Errorf("event %d has no choices but is not the closing usage chunk: %s", i, raw)
			}
			res.usage = *c.Usage
			continue
		}
		if res.finish != "" {
			return result{}, fmt.Errorf("event %d comes after the finish_reason chunk: %s", i, raw)
		}
		ch := c.Choices[0]
		if endpoint == openai.Chat {
			if ch.Delta == nil {
				return result{}, fmt.Errorf("chat event %d has no delta: %s", i, raw)
			}
			if i == 0 {
				if ch.Delta.Role == nil || *ch.Delta.Role != "assistant" || ch.Delta.Content == nil || *ch.Delta.Content != "" {
					return result{}, fmt.Errorf("first chat event must be the role chunk, got %s", raw)
				}
				continue
			}
			if ch.Delta.Content != nil {
				res.text += *ch.Delta.Content
			}
		} else if ch.Text != nil {
			res.text += *ch.Text
		}
		tokens++
		if ch.FinishReason != nil {
			res.finish = *ch.FinishReason
		}
	}
	if res.finish == "" {
		return result{}, fmt.Errorf("no event carried finish_reason: %q", s.events)
	}
	if withUsage && res.usage.CompletionTokens != tokens {
		return result{}, fmt.Errorf("usage says %d completion tokens, stream had %d", res.usage.CompletionTokens, tokens)
	}
	if !withUsage && res.usage != (openai.Usage{}) {
		return result{}, fmt.Errorf("usage chunk without include_usage")
	}
	return res, nil
}

// parseStream is checkStream for the test goroutine.
func parseStream(t *testing.T, s stream, endpoint openai.Endpoint, withUsage bool) result {
	t.Helper()
	res, err := checkStream(s, endpoint, withUsage)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// checkResponse reads a non-streaming chat or completions response.
func checkResponse(r response) (result, json.RawMessage, error) {
	if r.status != http.StatusOK {
		return result{}, nil, fmt.Errorf("status = %d, want 200; body: %s", r.status, r.body)
	}
	var v struct {
		ID      string `json:"id"`
		Choices []struct {
			Message *struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			} `json:"message"`
			Text         *string `json:"text"`
			FinishReason string  `json:"finish_reason"`
		} `json:"choices"`
		Usage            *openai.Usage   `json:"usage"`
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(r.body, &v); err != nil {
		return result{}, nil, fmt.Errorf("response body %q: %w", r.body, err)
	}
	if len(v.Choices) != 1 || v.Usage == nil {
		return result{}, nil, fmt.Errorf("response %s: want one choice and usage", r.body)
	}
	res := result{id: v.ID, finish: v.Choices[0].FinishReason, usage: *v.Usage}
	switch {
	case v.Choices[0].Message != nil:
		res.text = v.Choices[0].Message.Content
	case v.Choices[0].Text != nil:
		res.text = *v.Choices[0].Text
	}
	return res, v.KVTransferParams, nil
}

// parseResponse is checkResponse for the test goroutine.
func parseResponse(t *testing.T, r response) (result, json.RawMessage) {
	t.Helper()
	res, kv, err := checkResponse(r)
	if err != nil {
		t.Fatal(err)
	}
	return res, kv
}
