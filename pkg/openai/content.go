package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
)

// Message is one chat message. Content is a string, a list of content parts,
// or null.
type Message struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// Part is one content part of a chat message. Only text parts are read;
// the others (image_url, input_audio, video_url, ...) pass through to the
// engines untouched, and Raw holds the part as the client sent it.
type Part struct {
	Type string
	// Text is the text of a "text" part.
	Text string
	Raw  json.RawMessage
}

// Parts returns the content of a message as parts: a string is one text
// part, null is none.
func (m Message) Parts() ([]Part, error) {
	c := bytes.TrimSpace(m.Content)
	if len(c) == 0 || bytes.Equal(c, []byte("null")) {
		return nil, nil
	}
	var s string
	if err := json.Unmarshal(c, &s); err == nil {
		return []Part{{Type: "text", Text: s, Raw: c}}, nil
	}
	var raws []json.RawMessage
	if err := json.Unmarshal(c, &raws); err != nil {
		return nil, errors.New("must be a string or a list of content parts")
	}
	parts := make([]Part, 0, len(raws))
	for i, raw := range raws {
		var p struct {
			Type string  `json:"type"`
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(raw, &p); err != nil {
			return nil, fmt.Errorf("part %d must be an object", i)
		}
		switch {
		case p.Type == "":
			return nil, fmt.Errorf("part %d has no type", i)
		case p.Type == "text" && p.Text == nil:
			return nil, fmt.Errorf("part %d: a text part needs 'text'", i)
		case p.Type == "text":
			parts = append(parts, Part{Type: p.Type, Text: *p.Text, Raw: raw})
		default:
			parts = append(parts, Part{Type: p.Type, Raw: raw})
		}
	}
	return parts, nil
}

// textBytes is the length of a message's text, for the prompt-length
// estimate. A string's is the length of its JSON form less the quotes:
// unescaping a long prompt only to count it cost a full copy and a scan.
// Escapes make it an upper bound ("\u00e9" counts 6 for 2 bytes), which
// is close enough to tell a short prompt from a long one.
// Content parts are read as Text reads them.
func (m Message) textBytes() (int, error) {
	c := bytes.TrimSpace(m.Content)
	switch {
	case len(c) >= 2 && c[0] == '"':
		return len(c) - 2, nil // json.Unmarshal checked it is a valid string
	case len(c) > 0 && c[0] == '[':
		return partsTextBytes(c)
	}
	text, err := m.Text()
	return len(text), err
}

// partsTextBytes is textBytes of a list of content parts. The parts are
// read with jsonobj's scanner, which skips over a long text; decoding it as
// Parts does scanned it about six times (docs/benchmarks.md). The
// scanner matches keys exactly, as vLLM does; whatever it cannot count
// (a part it would refuse, or one with a key twice or in another letter
// case, which Go's decoder reads) is left to Text, so that what is
// refused, and how, is Parts' decision.
func partsTextBytes(c []byte) (int, error) {
	if n, ok := scanPartsText(c); ok {
		return n, nil
	}
	text, err := Message{Content: c}.Text()
	return len(text), err
}

// scanPartsText counts the text bytes of a list of content parts, or
// reports that it cannot: Text then decides, and words the refusal.
func scanPartsText(c []byte) (int, bool) {
	isNull := func(v []byte) bool { return v == nil || string(v) == "null" }
	n, texts := 0, 0
	err := jsonobj.LookupEach(c, []string{"type", "text"}, func(_ int, _ []byte, v []json.RawMessage, folds []int) error {
		// Only when each key is there once, in this letter case: Parts
		// (encoding/json) would read another spelling, or refuse it.
		for k := range v {
			if folds[k] != 0 && (folds[k] > 1 || v[k] == nil) {
				return errSlowPath
			}
		}
		var typ string
		if !isNull(v[0]) && json.Unmarshal(v[0], &typ) != nil {
			return errSlowPath
		}
		if !isNull(v[1]) && v[1][0] != '"' {
			return errSlowPath
		}
		switch {
		case typ == "", typ == "text" && isNull(v[1]):
			return errSlowPath
		case typ == "text":
			n += len(v[1]) - 2
			texts++
		}
		return nil
	})
	if err != nil {
		return 0, false
	}
	if texts > 1 {
		n += texts - 1 // Text joins them with newlines
	}
	return n, true
}

// Text returns the text of a message: the string, or its text parts joined
// by newlines. Other parts (images, audio, video) are left out: the engine
// reads them, pdq only estimates the prompt's length from its text.
func (m Message) Text() (string, error) {
	parts, err := m.Parts()
	if err != nil {
		return "", err
	}
	if len(parts) == 1 && parts[0].Type == "text" {
		return parts[0].Text, nil
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if p.Type == "text" {
			texts = append(texts, p.Text)
		}
	}
	return strings.Join(texts, "\n"), nil
}

// Prompt is a parsed completions prompt: text or token ids.
type Prompt struct {
	Text   string
	Tokens []int
}

// ParsePrompts reads a completions prompt as vLLM does: a string, a list
// of token ids, or a list of strings or of token-id lists (a batch, one
// answer choice per prompt).
func ParsePrompts(raw json.RawMessage) ([]Prompt, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, errors.New("'prompt' is required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []Prompt{{Text: s}}, nil
	}
	var ids []int
	if json.Unmarshal(raw, &ids) == nil {
		if len(ids) == 0 {
			return nil, errors.New("'prompt' must not be empty")
		}
		return []Prompt{{Tokens: ids}}, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil || len(list) == 0 {
		return nil, errors.New("'prompt' must be a string, a list of token ids, or a list of strings or of token-id lists")
	}
	prompts := make([]Prompt, 0, len(list))
	for i, item := range list {
		if i > 0 && (prompts[0].Tokens == nil) != (bytes.TrimSpace(item)[0] == '"') {
			// vLLM's schema: a list of strings or a list of token lists.
			return nil, errors.New("'prompt' must not mix strings and token-id lists")
		}
		item = bytes.TrimSpace(item)
		if json.Unmarshal(item, &s) == nil {
			prompts = append(prompts, Prompt{Text: s})
			continue
		}
		ids = nil
		if len(item) > 0 && item[0] == '[' && json.Unmarshal(item, &ids) == nil && len(ids) > 0 {
			prompts = append(prompts, Prompt{Tokens: ids})
			continue
		}
		return nil, fmt.Errorf("'prompt'[%d] must be a string or a non-empty list of token ids", i)
	}
	return prompts, nil
}
