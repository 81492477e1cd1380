package workers

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/jsonobj"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Keys of the request body that a continuation sets or removes.
const (
	keyKVTransferParams    = "kv_transfer_params"
	keyMaxTokens           = "max_tokens"
	keyMaxCompletionTokens = "max_completion_tokens"
	keyMinTokens           = "min_tokens"
	keyMinCompletionTokens = "min_completion_tokens"
)

// Migration: a decode that fails after output goes on, on another decode
// engine, from the text generated so far. The worker that failed keeps a
// transcript of what it relayed; from it and the request it builds the
// continuation (completions: the prompt plus the text; chat: the partial
// answer as a final assistant message with continue_final_message), with
// the token limits reduced by what was sent. The worker that continues
// rewrites its chunks so the client sees one stream: the first created
// time, no second role chunk, and usage that counts the original prompt
// and every generated token.

// transcript is what a streamed decode has relayed: its text, tokens and
// created time. It counts a token per chunk that carries text, which is
// how vLLM streams (an estimate: speculative decoding or text held back at
// a stop string puts several tokens in a chunk); with continuous usage
// stats the engine's own count replaces it. The chunks are kept as they
// came and read only if a migration needs them, or once they pass
// maxTranscriptRaw: the streaming path, which runs once per token, parses
// nothing but a long stream's chunks every 256 KiB.
type transcript struct {
	raw      [][]byte // relayed, not read yet
	rawBytes int      // their size
	// tooLong is set once the text passed maxTranscriptText: no
	// continuation is built from it.
	tooLong bool

	text     strings.Builder
	tokens   int
	created  int64
	finished bool // a chunk carried a finish_reason: nothing is left to generate
	// opaque means a chunk carried output that is not text (tool calls,
	// reasoning), which a continuation could not be built from.
	opaque bool
}

// chunk is the part of a streamed chunk that migration reads.
type chunk struct {
	Created int64 `json:"created"`
	Choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Content          *string         `json:"content"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
			FunctionCall     json.RawMessage `json:"function_call"`
			Reasoning        *string         `json:"reasoning"`
			ReasoningContent *string         `json:"reasoning_content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// The transcript's bounds. Chunks are kept as they came, and read (JSON
// decoded) only when a decode fails, so that a stream that ends well costs
// no decode per token; but a long stream's chunks (about 250 bytes a
// token) are read and let go past maxTranscriptRaw, keeping only their
// text. The text itself is bounded too: a continuation carries it in its
// body, within a NATS message.
const (
	maxTranscriptRaw  = 256 << 10
	maxTranscriptText = 1 << 20
)

// add keeps one relayed chunk, for read.
func (t *transcript) add(data []byte) {
	t.raw = append(t.raw, data)
	if t.rawBytes += len(data); t.rawBytes > maxTranscriptRaw {
		t.read()
	}
}

// read takes in the chunks kept since the last read.
func (t *transcript) read() {
	for _, data := range t.raw {
		t.readChunk(data)
	}
	clear(t.raw) // the slice is kept for the next chunks, not what it held
	t.raw, t.rawBytes = t.raw[:0], 0
}

func (t *transcript) readChunk(data []byte) {
	var c chunk
	if json.Unmarshal(data, &c) != nil {
		return
	}
	if t.created == 0 {
		t.created = c.Created
	}
	for _, ch := range c.Choices {
		var s *string
		switch {
		case ch.Text != nil:
			s = ch.Text
		case ch.Delta != nil:
			s = ch.Delta.Content
			d := ch.Delta
			if !jsonobj.Empty(d.ToolCalls) || !jsonobj.Empty(d.FunctionCall) || (d.Reasoning != nil && *d.Reasoning != "") ||
				(d.ReasoningContent != nil && *d.ReasoningContent != "") {
				t.opaque = true
			}
		}
		if s != nil && *s != "" {
			if t.text.Len()+len(*s) > maxTranscriptText {
				t.tooLong = true
			} else {
				t.text.WriteString(*s)
			}
			t.tokens++
		}
		if ch.FinishReason != nil && *ch.FinishReason != "" {
			t.finished = true
		}
	}
	if c.Usage != nil && c.Usage.CompletionTokens > 0 {
		// continuous_usage_stats: the engine's own count beats ours.
		t.tokens = c.Usage.CompletionTokens
	}
}

// errNotContinuable is why a request cannot be migrated.
var errNotContinuable = errors.New("the request cannot be continued on another engine")

// continuable reports why a request cannot be continued from partial
// output, or nil: several choices (n, best_of) or beam search cannot be
// rebuilt from one text, echo would repeat the prompt, constrained output
// (guided_*, structured_outputs, a JSON response_format, a required tool
// call) would restart its grammar mid-answer, and a completions prompt must
// be one string to append to.
func continuable(endpoint openai.Endpoint, body []byte) error {
	var r struct {
		N              *int            `json:"n"`
		BestOf         *int            `json:"best_of"`
		UseBeamSearch  bool            `json:"use_beam_search"`
		Echo           bool            `json:"echo"`
		Prompt         json.RawMessage `json:"prompt"`
		ResponseFormat *struct {
			Type string `json:"type"`
		} `json:"response_format"`
		ToolChoice json.RawMessage `json:"tool_choice"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return fmt.Errorf("%w: %w", errNotContinuable, err)
	}
	// Constrained output: the grammar would start again mid-answer.
	guided := []string{"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
	vals, err := jsonobj.Lookup(body, guided...)
	if err != nil {
		return fmt.Errorf("%w: %w", errNotContinuable, err)
	}
	for i, v := range vals {
		if !jsonobj.Empty(v) {
			return fmt.Errorf("%w: %s", errNotContinuable, guided[i])
		}
	}
	if r.ResponseFormat != nil && r.ResponseFormat.Type != "" && r.ResponseFormat.Type != "text" {
		return fmt.Errorf("%w: response_format %s", errNotContinuable, r.ResponseFormat.Type)
	}
	if tc := string(bytes.TrimSpace(r.ToolChoice)); tc != "" && tc != "null" && tc != `"none"` && tc != `"auto"` {
		return fmt.Errorf("%w: tool_choice %s", errNotContinuable, truncate(tc, 40))
	}
	switch {
	case r.N != nil && *r.N > 1:
		return fmt.Errorf("%w: n=%d", errNotContinuable, *r.N)
	case r.BestOf != nil && *r.BestOf > 1:
		return fmt.Errorf("%w: best_of=%d", errNotContinuable, *r.BestOf)
	case r.UseBeamSearch:
		return fmt.Errorf("%w: beam search", errNotContinuable)
	case r.Echo:
		return fmt.Errorf("%w: echo", errNotContinuable)
	}
	if endpoint == openai.Completions {
		var one string
		if json.Unmarshal(r.Prompt, &one) != nil {
			var list []string
			if json.Unmarshal(r.Prompt, &list) != nil || len(list) != 1 {
				return fmt.Errorf("%w: the prompt is not one string", errNotContinuable)
			}
		}
	}
	return nil
}

// ContinueBody is the request that goes on from text: for completions the
// prompt with text appended; for chat the messages with text as the final
// assistant message (appended to it, if the request already continues
// one), continue_final_message set and add_generation_prompt unset. The
// token limits are reduced by tokens. The body is spliced (see
// [jsonobj.Edit]): the other fields, and the other messages, keep their
// bytes.
func ContinueBody(endpoint openai.Endpoint, body []byte, text string, tokens int) ([]byte, error) {
	limits := [...]string{keyMaxTokens, keyMaxCompletionTokens, keyMinTokens, keyMinCompletionTokens}
	vals, err := jsonobj.Lookup(body, "prompt", "messages", "continue_final_message",
		limits[0], limits[1], limits[2], limits[3])
	if err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	var buf [len(limits) + 4]jsonobj.Op
	ops := buf[:0]
	switch endpoint {
	case openai.Completions:
		prompt := vals[0]
		if len(prompt) > 0 && prompt[0] == '[' {
			// A list of one prompt becomes that prompt.
			spans, err := jsonobj.Elements(prompt)
			if err != nil || len(spans) != 1 {
				return nil, fmt.Errorf("%w: the prompt is not one string", errNotContinuable)
			}
			prompt = prompt[spans[0].Start:spans[0].End]
		}
		joined, ok := appendText(prompt, text)
		if !ok {
			return nil, fmt.Errorf("%w: the prompt is not one string", errNotContinuable)
		}
		ops = append(ops, jsonobj.Set("prompt", joined))
	case openai.Chat:
		msgs, err := continueMessages(vals[1], vals[2], text)
		if err != nil {
			return nil, err
		}
		ops = append(ops, jsonobj.Set("messages", msgs),
			jsonobj.Set("continue_final_message", []byte("true")),
			jsonobj.Set("add_generation_prompt", []byte("false")))
	}
	for i, key := range limits {
		raw := vals[3+i]
		if raw == nil || string(raw) == "null" {
			continue
		}
		var n int
		if err := json.Unmarshal(raw, &n); err != nil {
			return nil, fmt.Errorf("%s: %w", key, err)
		}
		n -= tokens
		if key == keyMaxTokens || key == keyMaxCompletionTokens {
			n = max(n, 1)
		}
		if n <= 0 {
			ops = append(ops, jsonobj.Delete(key))
			continue
		}
		ops = append(ops, jsonobj.Set(key, strconv.AppendInt(nil, int64(n), 10)))
	}
	ops = append(ops, jsonobj.Delete(keyKVTransferParams))
	return jsonobj.Edit(body, ops...)
}

// continueMessages returns the chat messages with text as the final
// assistant message: appended to the last message if it is the
// assistant's and cont (continue_final_message) is true, else a message of
// its own. Only the message that grows is rewritten.
func continueMessages(messages, cont json.RawMessage, text string) ([]byte, error) {
	spans, err := jsonobj.Elements(messages)
	if err != nil {
		return nil, fmt.Errorf("messages: %w", err)
	}
	continues := false
	if cont != nil {
		_ = json.Unmarshal(cont, &continues)
	}
	if n := len(spans); continues && n > 0 {
		last := spans[n-1]
		msg := messages[last.Start:last.End]
		vals, err := jsonobj.Lookup(msg, "role", "content")
		if err != nil {
			return nil, fmt.Errorf("messages: %w", err)
		}
		if string(vals[0]) == `"assistant"` {
			content, ok := appendText(vals[1], text)
			if !ok {
				return nil, fmt.Errorf("%w: the final message's content is not a string", errNotContinuable)
			}
			if msg, err = jsonobj.Edit(msg, jsonobj.Set("content", content)); err != nil {
				return nil, err
			}
			out := make([]byte, 0, len(messages)-(last.End-last.Start)+len(msg))
			out = append(out, messages[:last.Start]...)
			out = append(out, msg...)
			return append(out, messages[last.End:]...), nil
		}
	}
	// After the last message, or before the ']' that ends messages (Lookup
	// trims values).
	end := len(messages) - 1
	if n := len(spans); n > 0 {
		end = spans[n-1].End
	}
	out := make([]byte, 0, len(messages)+len(text)+48)
	out = append(out, messages[:end]...)
	if len(spans) > 0 {
		out = append(out, ',')
	}
	out = append(out, `{"role":"assistant","content":`...)
	out = jsonobj.AppendString(out, text)
	out = append(out, '}')
	return append(out, messages[end:]...), nil
}

// appendText returns the JSON string raw with text appended, without
// decoding it. null reads as "", as it does into a Go string; anything
// else is not a string (false).
func appendText(raw []byte, text string) ([]byte, bool) {
	switch {
	case string(raw) == "null":
		return jsonobj.AppendString(nil, text), true
	case len(raw) < 2 || raw[0] != '"':
		return nil, false
	}
	out := append(make([]byte, 0, len(raw)+len(text)+8), raw[:len(raw)-1]...)
	out = jsonobj.AppendString(out, text) // ..."text": one quote too many
	return append(out[:len(raw)-1], out[len(raw):]...), true
}

// continuation rewrites the chunks of a migrated decode so that they
// continue the client's stream.
type continuation struct {
	resume    dispatcher.Resume
	chat      bool
	roleFound bool // the continuation's own role chunk has been dropped
}

// rewrite returns the chunk as the client must see it, or nil to drop it.
func (c *continuation) rewrite(data []byte) []byte {
	if c.chat && !c.roleFound && isRoleChunk(data) {
		c.roleFound = true
		return nil // the client had its role chunk from the first engine
	}
	return fixChunk(data, c.resume.Created, c.resume.Tokens)
}

// isRoleChunk reports whether a chat chunk only opens the assistant's
// message: role and empty content.
func isRoleChunk(data []byte) bool {
	var c struct {
		Choices []struct {
			Delta map[string]json.RawMessage `json:"delta"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &c) != nil || len(c.Choices) != 1 {
		return false
	}
	d := c.Choices[0].Delta
	if _, ok := d["role"]; !ok {
		return false
	}
	content, ok := d["content"]
	return !ok || string(content) == `""` || string(content) == "null"
}

// fixChunk gives a chunk the stream's first created time (unless 0), and
// moves tokens from prompt_tokens to completion_tokens in its usage, if it
// has any: the continuation's prompt held the text generated before it.
// Only those values change, at the top level of the chunk; a chunk that is
// not a JSON object goes out as it came.
func fixChunk(data []byte, created int64, tokens int) []byte {
	var ops [2]jsonobj.Op
	n := 0
	var num [20]byte
	if created != 0 {
		ops[n] = jsonobj.Replace("created", strconv.AppendInt(num[:0], created, 10))
		n++
	}
	if tokens != 0 {
		if usage := shiftUsage(data, tokens); usage != nil {
			ops[n] = jsonobj.Replace("usage", usage)
			n++
		}
	}
	out, err := jsonobj.Edit(data, ops[:n]...)
	if err != nil {
		return data
	}
	return out
}

// shiftUsage returns the chunk's usage with tokens moved from prompt_tokens
// to completion_tokens, or nil when it has no usage that counts both.
func shiftUsage(data []byte, tokens int) []byte {
	usage, _, err := jsonobj.Get(data, "usage")
	if err != nil || len(usage) == 0 || usage[0] != '{' {
		return nil // none, null, or not an object
	}
	vals, err := jsonobj.Lookup(usage, "prompt_tokens", "completion_tokens")
	var prompt, completion int
	if err != nil || json.Unmarshal(vals[0], &prompt) != nil || json.Unmarshal(vals[1], &completion) != nil {
		return nil
	}
	var p, c [20]byte
	out, err := jsonobj.Edit(usage,
		jsonobj.Replace("prompt_tokens", strconv.AppendInt(p[:0], int64(max(prompt-tokens, 0)), 10)),
		jsonobj.Replace("completion_tokens", strconv.AppendInt(c[:0], int64(completion+tokens), 10)))
	if err != nil {
		return nil
	}
	return out
}
