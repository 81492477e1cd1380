package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
	"github.com/pdq-dev/pdq/pkg/nixl"
)

// Output is what one request gave, vLLM's RequestFuncOutput. Times are in
// seconds.
type Output struct {
	GeneratedText string
	Success       bool
	// Latency is the end-to-end latency: from sending the request (the
	// prefill leg, with --pd-prefill) to the last message with a choice.
	Latency float64
	// OutputTokens is usage.completion_tokens (0 when the stream had no
	// usage).
	OutputTokens int
	// TTFT is the time to the first message with a choice.
	TTFT float64
	// ITL are the gaps between later messages with a choice.
	ITL []float64
	// PromptLen is usage.prompt_tokens, else the dataset's prompt length.
	PromptLen int
	Error     string
	// StartTime is when the request was sent, from the start of the run.
	StartTime float64
	// ClientQueueTime is how long the request waited for a
	// --max-concurrency slot.
	ClientQueueTime float64
	// CachedTokens is usage.prompt_tokens_details.cached_tokens;
	// CachedReported says the server sent prompt_tokens_details.
	CachedTokens   int
	CachedReported bool
}

// client sends the requests of a run.
type client struct {
	http *http.Client
	// apiURL is the base URL and endpoint; prefillURL, if not empty, the
	// prefill engine's base URL and the same endpoint.
	apiURL, prefillURL string
	chat               bool
	model              string
	apiKey             string
	// origin is the start of the run, that StartTime counts from.
	origin time.Time
}

// completionsBody is vLLM's async_request_openai_completions payload, in
// its order.
type completionsBody struct {
	Model             string        `json:"model"`
	Prompt            string        `json:"prompt"`
	RepetitionPenalty float64       `json:"repetition_penalty"`
	MaxTokens         int           `json:"max_tokens"`
	Logprobs          *int          `json:"logprobs"`
	Stream            bool          `json:"stream"`
	StreamOptions     streamOptions `json:"stream_options"`
	IgnoreEOS         bool          `json:"ignore_eos"` // always set: see Config's --ignore-eos
	User              string        `json:"user,omitempty"`
	Priority          *int          `json:"priority,omitempty"`
}

// chatBody is vLLM's async_request_openai_chat_completions payload.
type chatBody struct {
	Model               string        `json:"model"`
	Messages            []chatMessage `json:"messages"`
	MaxCompletionTokens int           `json:"max_completion_tokens"`
	Stream              bool          `json:"stream"`
	StreamOptions       streamOptions `json:"stream_options"`
	IgnoreEOS           bool          `json:"ignore_eos"`
	User                string        `json:"user,omitempty"`
	Priority            *int          `json:"priority,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatMessage struct {
	Role    string     `json:"role"`
	Content []chatPart `json:"content"`
}

type chatPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// body is the request's JSON.
func (c *client) body(req SampleRequest) ([]byte, error) {
	if c.chat {
		msgs := make([]chatMessage, 0, len(req.History)+1)
		for _, m := range req.History {
			msgs = append(msgs, chatMessage{Role: m.Role, Content: []chatPart{{Type: "text", Text: m.Text}}})
		}
		return json.Marshal(chatBody{
			Model:               c.model,
			Messages:            append(msgs, chatMessage{Role: "user", Content: []chatPart{{Type: "text", Text: req.Prompt}}}),
			MaxCompletionTokens: req.OutputLen,
			Stream:              true,
			StreamOptions:       streamOptions{IncludeUsage: true},
			IgnoreEOS:           true,
			User:                req.Tenant,
			Priority:            req.Priority,
		})
	}
	return json.Marshal(completionsBody{
		Model:             c.model,
		Prompt:            req.Prompt,
		RepetitionPenalty: 1.0,
		MaxTokens:         req.OutputLen,
		Stream:            true,
		StreamOptions:     streamOptions{IncludeUsage: true},
		IgnoreEOS:         true,
		User:              req.Tenant,
		Priority:          req.Priority,
	})
}

// ChatBody is the JSON body that the openai-chat backend sends for req,
// for tools that size a load by its bytes (make bench).
func ChatBody(model string, req SampleRequest) ([]byte, error) {
	return (&client{chat: true, model: model}).body(req)
}

// post sends body to url with vLLM's headers.
func (c *client) post(ctx context.Context, url string, body []byte, requestID string) (*http.Response, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	if c.apiKey != "" {
		hr.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	hr.Header.Set("X-Request-Id", requestID)
	return c.http.Do(hr)
}

// errNoChunk is vLLM's error for a stream without a choice, word for word.
const errNoChunk = "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"

// do sends one request and times its stream as vLLM's request functions
// do. A request fails on a status other than 200, on a transport or JSON
// error, or when no message carried a choice. With a prefill URL, the
// prefill leg goes first (see prefill), and the clock starts before it.
func (c *client) do(ctx context.Context, req SampleRequest) Output {
	out := Output{PromptLen: req.PromptLen}
	body, err := c.body(req)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	st := time.Now()
	out.StartTime = st.Sub(c.origin).Seconds()
	if c.prefillURL != "" {
		if body, err = c.prefill(ctx, body, req.RequestID); err != nil {
			out.Error = err.Error()
			return out
		}
	}
	resp, err := c.post(ctx, c.apiURL, body, req.RequestID)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		out.Error = statusError(resp)
		return out
	}
	if err := c.readStream(resp.Body, st, &out); err != nil {
		out.Success = false
		out.Error = err.Error()
	}
	return out
}

// chunk is what vLLM reads of a stream message.
type chunk struct {
	Choices []struct {
		Text  *string `json:"text"`
		Delta struct {
			Content *string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage map[string]json.RawMessage `json:"usage"`
}

// readStream reads the SSE stream: the first message with a non-empty
// choices list sets TTFT, each later one adds an ITL gap, and the last
// one ends the latency; a message without choices but with usage gives
// the token counts. Comments, [DONE] and lines other than data are
// skipped.
func (c *client) readStream(r io.Reader, st time.Time, out *Output) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var text strings.Builder
	last := st
	first := true
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			if perr := c.message(bytes.TrimSpace(line), st, &last, &first, &text, out); perr != nil {
				return perr
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
	}
	out.GeneratedText = text.String()
	if first {
		//lint:ignore ST1005 vLLM's own message, which its result files carry
		return errors.New(errNoChunk)
	}
	out.Success = true
	out.Latency = last.Sub(st).Seconds()
	return nil
}

func (c *client) message(line []byte, st time.Time, last *time.Time, first *bool, text *strings.Builder, out *Output) error {
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return nil
	}
	data = bytes.TrimSpace(data)
	if len(data) == 0 || bytes.Equal(data, []byte("[DONE]")) {
		return nil
	}
	ts := time.Now()
	var ch chunk
	if err := json.Unmarshal(data, &ch); err != nil {
		return fmt.Errorf("bad stream message %q: %w", truncate(string(data), 200), err)
	}
	if len(ch.Choices) > 0 {
		if *first {
			*first = false
			out.TTFT = ts.Sub(st).Seconds()
		} else {
			out.ITL = append(out.ITL, ts.Sub(*last).Seconds())
		}
		*last = ts
		if c.chat {
			if p := ch.Choices[0].Delta.Content; p != nil {
				text.WriteString(*p)
			}
		} else if p := ch.Choices[0].Text; p != nil {
			text.WriteString(*p)
		}
		return nil
	}
	if len(ch.Usage) > 0 {
		var n *int
		if json.Unmarshal(ch.Usage["completion_tokens"], &n) == nil && n != nil {
			out.OutputTokens = *n
		} else {
			out.OutputTokens = 0
		}
		if json.Unmarshal(ch.Usage["prompt_tokens"], &n) == nil && n != nil {
			out.PromptLen = *n
		}
		var details struct {
			CachedTokens int `json:"cached_tokens"`
		}
		if d := ch.Usage["prompt_tokens_details"]; len(d) > 0 && string(d) != "null" && json.Unmarshal(d, &details) == nil {
			out.CachedTokens, out.CachedReported = details.CachedTokens, true
		}
	}
	return nil
}

// prefill runs the prefill leg of body as vLLM's toy proxy does, with the
// bodies pdq's workers send (nixl.PrefillBody, nixl.DecodeBody: one handshake for both), and
// returns the body for the decode leg: body with the kv_transfer_params
// the prefill returned; when it returned none (null or {}) body goes
// unchanged, as the toy proxy sends it, and the decode engine prefills
// itself.
func (c *client) prefill(ctx context.Context, body []byte, requestID string) ([]byte, error) {
	pbody, err := nixl.PrefillBody(body)
	if err != nil {
		return nil, fmt.Errorf("prefill body: %w", err)
	}
	resp, err := c.post(ctx, c.prefillURL, pbody, requestID)
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("prefill: %s", statusError(resp))
	}
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	params, ok, err := jsonobj.Get(answer, "kv_transfer_params")
	if err != nil {
		return nil, fmt.Errorf("prefill: bad response: %w", err)
	}
	var m map[string]json.RawMessage
	if !ok || json.Unmarshal(params, &m) != nil || len(m) == 0 {
		return body, nil
	}
	dbody, err := nixl.DecodeBody(body, params)
	if err != nil {
		return nil, fmt.Errorf("decode body: %w", err)
	}
	return dbody, nil
}

// statusError is the error of a response whose status is not 200: its
// reason phrase, as vLLM's, then what the body says.
func statusError(resp *http.Response) string {
	msg := http.StatusText(resp.StatusCode)
	if msg == "" {
		msg = fmt.Sprintf("status %d", resp.StatusCode)
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if s := strings.TrimSpace(string(b)); s != "" {
		msg += ": " + truncate(s, 500)
	}
	return msg
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
