package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
)

// Request holds the fields of a chat or completions request that pdq reads.
// Everything else in the body is passed on untouched, so callers keep the raw
// bytes next to it; this struct is for reading, never for re-encoding a body.
type Request struct {
	Model    string    `json:"model"`
	Messages []Message `json:"messages"`
	// Prompt is a string, a list of token ids, or a list with one of those.
	Prompt json.RawMessage `json:"prompt"`

	Stream        bool           `json:"stream"`
	StreamOptions *StreamOptions `json:"stream_options"`

	MaxTokens           *int  `json:"max_tokens"`
	MaxCompletionTokens *int  `json:"max_completion_tokens"`
	MinTokens           *int  `json:"min_tokens"`
	N                   *int  `json:"n"`
	IgnoreEOS           bool  `json:"ignore_eos"`
	Echo                *bool `json:"echo"`
	// Priority is vLLM's: under --scheduling-policy priority, lower runs
	// first; other engines refuse any value but 0.
	Priority int `json:"priority"`
	// User is OpenAI's end-user id; pdq's gateway takes it as the tenant
	// when it takes no API keys.
	User string `json:"user"`

	// AddGenerationPrompt and ContinueFinalMessage are vLLM's chat template
	// switches (defaults true and false): a partial assistant message is
	// continued with add_generation_prompt false and continue_final_message
	// true.
	AddGenerationPrompt  *bool `json:"add_generation_prompt"`
	ContinueFinalMessage *bool `json:"continue_final_message"`

	// TruncatePromptTokens is vLLM's truncation of a prompt to its last k
	// tokens (-1: to the context length), before the length checks.
	TruncatePromptTokens *int `json:"truncate_prompt_tokens"`

	// RequestID is vLLM's body fallback for the X-Request-Id header.
	RequestID string `json:"request_id"`

	// KVTransferParams is opaque: its keys and value types differ between
	// vLLM versions.
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`

	// textBytes is the length of the messages' text, counted as
	// DecodeRequest checks them.
	textBytes int
	// prompts are a completions request's prompts, as DecodeRequest read
	// them.
	prompts []Prompt
	// limits are the max_tokens and max_completion_tokens members, by
	// their exact names as vLLM reads them (nil: absent), for EngineLimit.
	limits [2]json.RawMessage
}

// Prompts are a completions request's prompts, as DecodeRequest read them
// (one, or a batch): what its callers need without parsing them again.
func (r *Request) Prompts() []Prompt { return r.prompts }

// TextBytes is the length of a chat request's text (its messages' text
// parts), as read by DecodeRequest: what a prompt-length estimate needs,
// without parsing the messages again.
func (r *Request) TextBytes() int { return r.textBytes }

// StreamOptions is the stream_options object of a streaming request.
type StreamOptions struct {
	IncludeUsage         bool `json:"include_usage"`
	ContinuousUsageStats bool `json:"continuous_usage_stats"`
}

// Endpoint names the two generation endpoints.
type Endpoint string

// The endpoints pdq serves, with the prefix of their response ids.
const (
	Chat        Endpoint = "chat"
	Completions Endpoint = "completions"
)

// Path is the URL path of the endpoint under an engine's base URL.
func (e Endpoint) Path() string {
	if e == Chat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// IDPrefix is the prefix vLLM puts before the base request id in the
// response id.
func (e Endpoint) IDPrefix() string {
	if e == Chat {
		return "chatcmpl-"
	}
	return "cmpl-"
}

// DecodeRequest parses body as a request for endpoint and checks the fields
// every engine needs. Problems come back as a 400 *Error naming the field.
func DecodeRequest(endpoint Endpoint, body []byte) (*Request, *Error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, NewError(http.StatusBadRequest, "request body is empty")
	}
	req, ok := decodeFast(body)
	if !ok {
		// Unmarshal, not a Decoder: it also refuses anything after the
		// object, which engines would refuse later and less clearly.
		req = &Request{}
		if err := json.Unmarshal(body, req); err != nil {
			return nil, decodeError(err)
		}
		if limits, err := jsonobj.Lookup(body, "max_tokens", "max_completion_tokens"); err == nil {
			req.limits = [2]json.RawMessage{limits[0], limits[1]}
		}
	}
	if req.Model == "" {
		return nil, NewError(http.StatusBadRequest, "'model' is required").WithParam("model")
	}
	switch endpoint {
	case Chat:
		if len(req.Messages) == 0 {
			return nil, NewError(http.StatusBadRequest, "'messages' is required and must not be empty").WithParam("messages")
		}
		for i, m := range req.Messages {
			if m.Role == "" {
				return nil, NewError(http.StatusBadRequest, "messages[%d].role is required", i).WithParam("messages")
			}
			n, err := m.textBytes()
			if err != nil {
				return nil, NewError(http.StatusBadRequest, "messages[%d].content: %v", i, err).WithParam("messages")
			}
			req.textBytes += n
		}
	case Completions:
		prompts, err := ParsePrompts(req.Prompt)
		if err != nil {
			return nil, NewError(http.StatusBadRequest, "%v", err).WithParam("prompt")
		}
		req.prompts = prompts
	}
	completionTokens := req.MaxCompletionTokens
	if endpoint == Completions {
		completionTokens = nil // not a completions field: vLLM ignores it
	}
	for _, f := range []struct {
		name string
		v    *int
		min  int
	}{
		{"max_tokens", req.MaxTokens, 1},
		{"max_completion_tokens", completionTokens, 1},
		{"min_tokens", req.MinTokens, 0},
		{"n", req.N, 1},
	} {
		if f.v != nil && *f.v < f.min {
			return nil, NewError(http.StatusBadRequest, "'%s' must be at least %d, got %d", f.name, f.min, *f.v).WithParam(f.name)
		}
	}
	if len(req.KVTransferParams) > 0 && !isJSONObjectOrNull(req.KVTransferParams) {
		return nil, NewError(http.StatusBadRequest, "'kv_transfer_params' must be an object").WithParam("kv_transfer_params")
	}
	return req, nil
}

// decodeFast reads body as json.Unmarshal reads it into a Request, but
// leaves the long members, messages and prompt, to jsonobj's scanner.
// encoding/json scans a body twice (for validity, then for values), at
// far slower than the scanner, and copies every RawMessage
// (BenchmarkDecodeRequest; docs/benchmarks.md). Here one scan cuts the long
// members out (jsonobj.Cut), one more walks the messages (LookupEach),
// and textBytes a third their parts; the short members are decoded by
// encoding/json from what is left, and the messages' contents and the
// prompt stay slices of body. ok is false for anything it would not read
// exactly as json.Unmarshal does (invalid JSON, a message without "role"
// or "content", one of the keys it reads there in another letter case, or
// twice): the caller then decodes body the slow way, which also words the
// errors.
func decodeFast(body []byte) (req *Request, ok bool) {
	long, count, rest, err := jsonobj.Cut(body, "messages", "prompt")
	if err != nil || count[0] > 1 {
		// Messages given twice: encoding/json decodes the second list into
		// the structs the first one filled, where a null keeps what was
		// there. The slow path reads that as it does.
		return nil, false
	}
	req = &Request{}
	if json.Unmarshal(rest, req) != nil {
		return nil, false // an error to word
	}
	short, n, err := jsonobj.LookupFold(rest, "messages", "prompt", "max_tokens", "max_completion_tokens")
	if err != nil || n[0] != 0 || n[1] != 0 {
		return nil, false // "Messages" or "PROMPT" is there too, and encoding/json would read it
	}
	req.Prompt, req.limits = long[1], [2]json.RawMessage{short[2], short[3]}
	if m := long[0]; m != nil && string(m) != "null" {
		req.Messages = make([]Message, 0, 1)
		err := jsonobj.LookupEach(m, []string{"role", "content"}, func(_ int, _ []byte, v []json.RawMessage, folds []int) error {
			// Only when no "Role" or "CONTENT" is there too (folds), which
			// encoding/json would read in its place.
			var msg Message
			if v[0] == nil || v[1] == nil || folds[0] != 1 || folds[1] != 1 || json.Unmarshal(v[0], &msg.Role) != nil {
				return errSlowPath
			}
			msg.Content = v[1]
			req.Messages = append(req.Messages, msg)
			return nil
		})
		if err != nil {
			return nil, false
		}
	}
	return req, true
}

// errSlowPath stops a scan that found what only encoding/json should read.
var errSlowPath = errors.New("left to encoding/json")

// OutputLimit is the output limit the client asked for, as vLLM reads it
// for endpoint: for chat, max_completion_tokens when set (the newer name),
// else max_tokens; for completions, max_tokens only (vLLM's completions
// request has no max_completion_tokens). ok is false when it is unset.
func (r *Request) OutputLimit(endpoint Endpoint) (n int, ok bool) {
	if endpoint == Chat && r.MaxCompletionTokens != nil && *r.MaxCompletionTokens != 0 {
		return *r.MaxCompletionTokens, true
	}
	if r.MaxTokens != nil {
		return *r.MaxTokens, true
	}
	return 0, false
}

// DefaultCompletionTokens is vLLM's max_tokens of a completions request
// that sets none.
const DefaultCompletionTokens = 16

// OutputLimitOf reads a request body's output limit as vLLM does: as
// [Request.OutputLimit], and for completions without max_tokens vLLM's
// default, DefaultCompletionTokens (an explicit null is no limit). ok is
// false when there is no limit; err is set when body is not a JSON object
// with integer limits.
func OutputLimitOf(endpoint Endpoint, body []byte) (n int, ok bool, err error) {
	limits, err := jsonobj.Lookup(body, "max_tokens", "max_completion_tokens")
	if err != nil {
		return 0, false, err
	}
	return engineLimit(endpoint, limits[0], limits[1])
}

// EngineLimit is OutputLimitOf of the body the request was decoded from,
// from the members DecodeRequest found.
func (r *Request) EngineLimit(endpoint Endpoint) (n int, ok bool) {
	n, ok, _ = engineLimit(endpoint, r.limits[0], r.limits[1]) // they decoded as integers
	return n, ok
}

// engineLimit is OutputLimitOf's rule, on the raw max_tokens and
// max_completion_tokens members (nil: absent), matched by their exact
// names as vLLM matches them.
func engineLimit(endpoint Endpoint, maxTokens, maxCompletionTokens json.RawMessage) (n int, ok bool, err error) {
	var req Request
	for _, f := range []struct {
		raw json.RawMessage
		v   **int
	}{{maxTokens, &req.MaxTokens}, {maxCompletionTokens, &req.MaxCompletionTokens}} {
		if len(f.raw) > 0 && string(f.raw) != "null" {
			*f.v = new(int)
			if err := json.Unmarshal(f.raw, *f.v); err != nil {
				return 0, false, err
			}
		}
	}
	n, ok = req.OutputLimit(endpoint)
	if !ok && endpoint == Completions && maxTokens == nil {
		n, ok = DefaultCompletionTokens, true // none given; an explicit null is no limit
	}
	return n, ok, nil
}

// IncludeUsage reports whether a stream should end with a usage chunk.
func (r *Request) IncludeUsage() bool {
	return r.StreamOptions != nil && r.StreamOptions.IncludeUsage
}

func isJSONObjectOrNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return bytes.Equal(raw, []byte("null")) || (len(raw) > 0 && raw[0] == '{')
}

// decodeError turns a json decoding error into a 400 that says what was
// wrong and where, without echoing Go type names back to clients.
func decodeError(err error) *Error {
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) {
		field := typeErr.Field
		if field == "" {
			return NewError(http.StatusBadRequest, "request body must be a JSON object")
		}
		return NewError(http.StatusBadRequest, "invalid type for '%s': got a JSON %s", field, typeErr.Value).WithParam(field)
	}
	var syntaxErr *json.SyntaxError
	if errors.As(err, &syntaxErr) {
		return NewError(http.StatusBadRequest, "malformed JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	}
	if errors.Is(err, io.EOF) {
		return NewError(http.StatusBadRequest, "request body is empty")
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return NewError(http.StatusBadRequest, "malformed JSON: the body ends too early")
	}
	return NewError(http.StatusBadRequest, "malformed JSON: %v", err)
}
