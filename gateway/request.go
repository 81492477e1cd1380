package gateway

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"

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

// requestID reads the client's X-Request-Id: the id the client knows its
// request by, echoed and put back in the response ids, and the request's
// key (dispatcher.RequestKey), which the job, its record and both engine
// legs carry. They are the same for a subject-safe id, and for the UUID
// made when the client sent none. An id RequestKey does not take is a 400.
func requestID(header string) (clientID, key string, apiErr *openai.Error) {
	if header == "" {
		id := newUUID()
		return id, id, nil
	}
	key, err := dispatcher.RequestKey(header)
	if err != nil {
		return "", "", openai.NewError(http.StatusBadRequest, "%v", err)
	}
	return header, key, nil
}

// responseIDs puts the client's own X-Request-Id back into the response
// ids of a request whose key is not that id: the engines answer under the
// key (chatcmpl-<key>, cmpl-<key>), vLLM under the client's id.
type responseIDs struct {
	engine, client []byte // the ids, as JSON strings
}

// newResponseIDs returns nil when the key is the client's id: then there
// is nothing to put back.
func newResponseIDs(endpoint openai.Endpoint, clientID, key string) *responseIDs {
	if clientID == key {
		return nil
	}
	return &responseIDs{engine: jsonobj.AppendString(nil, endpoint.IDPrefix()+key),
		client: jsonobj.AppendString(nil, endpoint.IDPrefix()+clientID)}
}

// apply returns a response or chunk with the client's id where the engine
// put the key's; anything else (an error, another id) as it is.
func (r *responseIDs) apply(data []byte) []byte {
	if r == nil {
		return data
	}
	id, ok, err := jsonobj.Get(data, "id")
	if err != nil || !ok || !bytes.Equal(id, r.engine) {
		return data
	}
	out, err := jsonobj.Edit(data, jsonobj.Replace("id", r.client))
	if err != nil {
		return data
	}
	return out
}

// modelMissing reports whether parseRequest refused a body for naming no
// model.
func modelMissing(apiErr *openai.Error) bool {
	return apiErr.Code == http.StatusBadRequest && apiErr.Param != nil && *apiErr.Param == "model"
}

// defaultModel fills in the model of a request that names none ("model"
// absent, null or ""): vLLM serves such a request with its served model,
// and pdq with the only model it serves (whose decode workers are live).
// The body keeps the client's bytes but for the model's value, appended
// when the client sent no member; filled says whether it changed. With
// several models served it is a 400 that names them, with none a 404. A
// body that names a model, or is not a JSON object, is left as it is.
func defaultModel(body []byte, served map[string]json.RawMessage) (out []byte, filled bool, apiErr *openai.Error) {
	v, ok, err := jsonobj.Get(body, "model")
	if err != nil || ok && string(v) != "null" && string(v) != `""` {
		return body, false, nil
	}
	models := slices.Sorted(maps.Keys(served))
	switch len(models) {
	case 0:
		return nil, false, openai.NewError(http.StatusNotFound, "no model is served: no live decode worker").WithParam("model")
	case 1:
		out, err := jsonobj.Edit(body, jsonobj.Set("model", jsonobj.AppendString(nil, models[0])))
		if err != nil {
			return nil, false, openai.NewError(http.StatusBadRequest, "request body: %v", err)
		}
		return out, true, nil
	}
	return nil, false, modelRequired(models)
}

// modelRequired is the 400 of a request without a model while pdq serves
// several: it names them.
func modelRequired(models []string) *openai.Error {
	return openai.NewError(http.StatusBadRequest, "'model' is required: pdq serves %d models: `%s`",
		len(models), strings.Join(models, "`, `")).WithParam("model")
}

// newUUID returns a random (version 4) UUID.
func newUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
