package gateway

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/jsonobj"
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
	// batch holds the prompts of a completions request that sent several,
	// as the client wrote each, with their estimated lengths; nil for one.
	batch       []json.RawMessage
	batchTokens []int
}

// parseRequest checks a request body for endpoint. Every refusal is a 400
// with an OpenAI error envelope; parseRequest never panics on any input.
func parseRequest(endpoint openai.Endpoint, body []byte) (*incoming, *openai.Error) {
	req, apiErr := openai.DecodeRequest(endpoint, body)
	if apiErr != nil {
		return nil, apiErr
	}
	in := &incoming{req: req, body: body, promptTokens: estimateTokens(endpoint, req)}
	if endpoint == openai.Completions {
		if prompts := req.Prompts(); len(prompts) > 1 {
			if err := json.Unmarshal(req.Prompt, &in.batch); err != nil {
				return nil, openai.NewError(http.StatusBadRequest, "'prompt': %v", err).WithParam("prompt")
			}
			for _, p := range prompts {
				in.batchTokens = append(in.batchTokens, promptTokens(p))
			}
		}
	}
	if req.KVTransferParams != nil {
		// They name hosts a decode engine would connect to: a client must
		// never choose them.
		// In any letter case: Go's decoder matches fields so, and a
		// "KV_Transfer_Params" must not slip through.
		clean, err := jsonobj.Edit(body, jsonobj.DeleteFold("kv_transfer_params"))
		if err != nil {
			return nil, openai.NewError(http.StatusBadRequest, "request body: %v", err)
		}
		in.body, in.droppedKV = clean, true
	}
	return in, nil
}

// estimateTokens guesses the prompt's token count at four characters a
// token, as llm-d's P/D decider does. It only has to tell a short prompt
// from a long one.
func estimateTokens(endpoint openai.Endpoint, req *openai.Request) int {
	if endpoint == openai.Completions {
		if prompts := req.Prompts(); len(prompts) == 1 {
			return promptTokens(prompts[0])
		}
		return 0 // a batch: each prompt is estimated on its own
	}
	chars := req.TextBytes()
	return (chars + 3) / 4
}

// checkLength refuses, before any prefill runs, a request that a decode
// engine of the model would refuse for length (maxLen is the smallest
// context length they report, 0 when unknown), with vLLM's own messages. A prefill would otherwise run, hold its KV, and only then meet
// the decode engine's 400. Text prompts are counted by the engine only, so
// for them this catches an output limit that leaves no room for even one
// prompt token; token-id prompts are checked exactly.
func checkLength(endpoint openai.Endpoint, req *openai.Request, maxLen int) *openai.Error {
	if maxLen <= 0 {
		return nil
	}
	input, exact := 1, false // every prompt has at least one token
	if endpoint == openai.Completions {
		prompts := req.Prompts()
		exact = len(prompts) > 0
		for _, p := range prompts {
			input = max(input, len(p.Tokens))
			exact = exact && p.Tokens != nil
		}
	}
	if t := req.TruncatePromptTokens; t != nil {
		// The engine cuts the prompt first: to t tokens, or (-1) to fit.
		if *t < 0 {
			return nil
		}
		input = max(min(input, *t), 1)
	}
	if input >= maxLen {
		return openai.NewError(http.StatusBadRequest,
			"This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the input messages.",
			maxLen, input).WithParam("prompt")
	}
	out, limited := req.EngineLimit(endpoint)
	if !limited || out <= maxLen-input {
		return nil
	}
	has := strconv.Itoa(input)
	if !exact {
		has = "at least " + has
	}
	return openai.NewError(http.StatusBadRequest,
		"'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum context length is %d tokens and your request has %s input tokens (%d > %d - %d).",
		out, maxLen, has, out, maxLen, input).WithParam("max_tokens")
}

// promptTokens estimates one completions prompt's length.
func promptTokens(p openai.Prompt) int {
	if p.Tokens != nil {
		return len(p.Tokens)
	}
	return (len(p.Text) + 3) / 4
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
