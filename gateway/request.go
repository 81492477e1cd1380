package gateway

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// incoming is a checked client request, ready to become a job.
type incoming struct {
	req *openai.Request
	// body is the client's body without kv_transfer_params; the client's
	// bytes exactly when it sent none.
	body []byte
	// promptTokens estimates the prompt's length for the P/D decision.
	promptTokens int
	// droppedKV is set when the client sent kv_transfer_params.
	droppedKV bool
}

// parseRequest checks a request body for endpoint. Every refusal is a 400
// with an OpenAI error envelope; parseRequest never panics on any input.
func parseRequest(endpoint openai.Endpoint, body []byte) (*incoming, *openai.Error) {
	req, apiErr := openai.DecodeRequest(endpoint, body)
	if apiErr != nil {
		return nil, apiErr
	}
	in := &incoming{req: req, body: body, promptTokens: estimateTokens(endpoint, req)}
	if req.KVTransferParams != nil {
		// They name hosts a decode engine would connect to: a client must
		// never choose them.
		clean, err := dropKey(body, "kv_transfer_params")
		if err != nil {
			return nil, openai.NewError(http.StatusBadRequest, "request body: %v", err)
		}
		in.body, in.droppedKV = clean, true
	}
	return in, nil
}

// dropKey removes key from a JSON object, in any letter case (Go's decoder
// matches fields case-insensitively, so a "KV_Transfer_Params" would
// otherwise slip through). The other members keep their bytes exactly: no
// re-encoding, no escaping of <, > or &, no reordering; only the
// whitespace between members is not kept.
func dropKey(body []byte, key string) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, fmt.Errorf("not a JSON object")
	}
	var kept [][]byte
	dropped := false
	end := dec.InputOffset()
	for dec.More() {
		start := end
		for start < int64(len(body)) && (body[start] == ',' || isSpace(body[start])) {
			start++
		}
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		k, _ := tok.(string)
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return nil, err
		}
		end = dec.InputOffset()
		if strings.EqualFold(k, key) {
			dropped = true
			continue
		}
		kept = append(kept, body[start:end])
	}
	if !dropped {
		return body, nil
	}
	out := append([]byte{'{'}, bytes.Join(kept, []byte{','})...)
	return append(out, '}'), nil
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// estimateTokens guesses the prompt's token count at four characters a
// token, as llm-d's P/D decider does. It only has to tell a short prompt
// from a long one.
func estimateTokens(endpoint openai.Endpoint, req *openai.Request) int {
	if endpoint == openai.Completions {
		p, err := openai.ParsePrompt(req.Prompt)
		if err != nil {
			return 0
		}
		if p.Tokens != nil {
			return len(p.Tokens)
		}
		return (len(p.Text) + 3) / 4
	}
	chars := 0
	for _, m := range req.Messages {
		text, _ := m.Text()
		chars += len(text)
	}
	return (chars + 3) / 4
}

// requestID returns the client's X-Request-Id when it is a valid subject
// token, a new UUID when there is none, and a 400 otherwise.
func requestID(header string) (string, *openai.Error) {
	if header == "" {
		return newUUID(), nil
	}
	if !dispatcher.ValidRequestID(header) {
		return "", openai.NewError(http.StatusBadRequest,
			"invalid X-Request-Id: use 1 to 128 characters from A-Z, a-z, 0-9, '_' and '-'")
	}
	return header, nil
}

// newUUID returns a random (version 4) UUID.
func newUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
