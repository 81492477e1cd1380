package sim

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// readJSON reads a request body into v, answering 400 for what is not JSON.
func readJSON(w http.ResponseWriter, r *http.Request, v any) *openai.Error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return openai.NewError(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", tooBig.Limit)
		}
		return openai.NewError(http.StatusBadRequest, "cannot read the request body: %v", err)
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return openai.NewError(http.StatusBadRequest, "request body is empty")
	}
	if err := json.Unmarshal(body, v); err != nil {
		return openai.NewError(http.StatusBadRequest, "malformed JSON: %v", err)
	}
	return nil
}

// tokenizeRequest is vLLM's TokenizeCompletionRequest or, when it has
// messages, TokenizeChatRequest.
type tokenizeRequest struct {
	Model                *string          `json:"model"`
	Prompt               *string          `json:"prompt"`
	Messages             []openai.Message `json:"messages"`
	AddGenerationPrompt  *bool            `json:"add_generation_prompt"`
	ContinueFinalMessage bool             `json:"continue_final_message"`
	ReturnTokenStrs      bool             `json:"return_token_strs"`
}

// tokenizeResponse is vLLM's TokenizeResponse.
type tokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []int    `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

// tokenize serves POST /tokenize: {"model","prompt"} or {"model",
// "messages","add_generation_prompt","continue_final_message"}, plus
// "return_token_strs". The ids are the tokens the engine counts as
// prompt_tokens for the same prompt, so count equals that usage.
func (e *Engine) tokenize(w http.ResponseWriter, r *http.Request) {
	var in tokenizeRequest
	if apiErr := readJSON(w, r, &in); apiErr != nil {
		openai.WriteError(w, apiErr)
		return
	}
	if apiErr := e.knownModel(in.Model); apiErr != nil {
		openai.WriteError(w, apiErr)
		return
	}
	var ids []int
	for i, m := range in.Messages {
		if m.Role == "" {
			openai.WriteError(w, openai.NewError(http.StatusBadRequest, "messages[%d].role is required", i).WithParam("messages"))
			return
		}
	}
	switch {
	case in.Messages != nil:
		tmpl := tokenizer.ChatTemplate{AddGenerationPrompt: in.AddGenerationPrompt == nil || *in.AddGenerationPrompt,
			ContinueFinalMessage: in.ContinueFinalMessage}
		if tmpl.AddGenerationPrompt && tmpl.ContinueFinalMessage {
			openai.WriteError(w, openai.NewError(http.StatusBadRequest,
				"Cannot set both `continue_final_message` and `add_generation_prompt` to True."))
			return
		}
		text, err := tokenizer.Render(in.Messages, tmpl)
		if err != nil {
			openai.WriteError(w, openai.NewError(http.StatusBadRequest, "%v", err).WithParam("messages"))
			return
		}
		ids = text.IDs(e.cfg.MMTokens)
		for _, s := range text.Segs {
			if s.Media == nil {
				tokenizer.RememberLongTokens(s.Text)
			}
		}
	case in.Prompt != nil:
		ids = tokenizer.TextIDs(*in.Prompt)
		tokenizer.RememberLongTokens(*in.Prompt)
	default:
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "'prompt' or 'messages' is required"))
		return
	}
	resp := tokenizeResponse{Count: len(ids), MaxModelLen: e.cfg.MaxModelLen, Tokens: ids}
	if resp.Tokens == nil {
		resp.Tokens = []int{}
	}
	if in.ReturnTokenStrs {
		resp.TokenStrs = make([]string, len(ids))
		for i, id := range ids {
			resp.TokenStrs[i], _ = tokenizer.TokenString(id)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

// knownModel refuses a model this engine does not serve; none (nil) is
// its base model.
func (e *Engine) knownModel(model *string) *openai.Error {
	if model != nil {
		if _, ok := e.names.resolve(*model); !ok {
			return unknownModel(*model)
		}
	}
	return nil
}

// detokenize serves POST /detokenize {"model","tokens"} → {"prompt"}.
func (e *Engine) detokenize(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Model  *string `json:"model"`
		Tokens *[]int  `json:"tokens"`
	}
	if apiErr := readJSON(w, r, &in); apiErr != nil {
		openai.WriteError(w, apiErr)
		return
	}
	if apiErr := e.knownModel(in.Model); apiErr != nil {
		openai.WriteError(w, apiErr)
		return
	}
	if in.Tokens == nil {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "'tokens' is required").WithParam("tokens"))
		return
	}
	text, err := tokenizer.DecodeIDs(*in.Tokens)
	if err != nil {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "%v", err).WithParam("tokens"))
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Prompt string `json:"prompt"`
	}{text})
}

// version serves GET /version as vLLM does: {"version": "..."}.
func (e *Engine) version(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, struct {
		Version string `json:"version"`
	}{e.cfg.Version})
}

// embeddingUsage is vLLM's UsageInfo as an embedding response has it.
type embeddingUsage struct {
	PromptTokens        int  `json:"prompt_tokens"`
	TotalTokens         int  `json:"total_tokens"`
	CompletionTokens    int  `json:"completion_tokens"`
	PromptTokensDetails *any `json:"prompt_tokens_details"`
}

// embeddingData is one vector: a list of floats, or with encoding_format
// base64 their little-endian float32 bytes in base64.
type embeddingData struct {
	Index     int    `json:"index"`
	Object    string `json:"object"`
	Embedding any    `json:"embedding"`
}

// embeddingResponse is vLLM's EmbeddingResponse.
type embeddingResponse struct {
	ID      string          `json:"id"`
	Object  string          `json:"object"`
	Created int64           `json:"created"`
	Model   string          `json:"model"`
	Data    []embeddingData `json:"data"`
	Usage   embeddingUsage  `json:"usage"`
}

// embeddings serves POST /v1/embeddings on a pooling engine: {"model",
// "input" (a string, a list of strings, a list of token ids or of lists of
// them) or "messages", "encoding_format", "dimensions"}. Each input gets a
// deterministic unit vector made from its tokens (and the adapter).
func (e *Engine) embeddings(w http.ResponseWriter, r *http.Request) {
	e.stats.requests.Add(1)
	if e.dead.Load() {
		e.fail(w, openai.NewError(http.StatusInternalServerError, engineDeadMessage))
		return
	}
	var in struct {
		Model          string           `json:"model"`
		Input          json.RawMessage  `json:"input"`
		Messages       []openai.Message `json:"messages"`
		EncodingFormat string           `json:"encoding_format"`
		Dimensions     *int             `json:"dimensions"`
		RequestID      string           `json:"request_id"`
	}
	if apiErr := readJSON(w, r, &in); apiErr != nil {
		e.fail(w, apiErr)
		return
	}
	tgt, ok := e.names.resolve(in.Model)
	if !ok {
		e.fail(w, unknownModel(in.Model))
		return
	}
	dim := e.cfg.EmbeddingDim
	if in.Dimensions != nil {
		if *in.Dimensions < 1 || *in.Dimensions > dim {
			e.fail(w, openai.NewError(http.StatusBadRequest, "'dimensions' must be between 1 and %d, got %d", dim, *in.Dimensions).WithParam("dimensions"))
			return
		}
		dim = *in.Dimensions
	}
	if in.EncodingFormat != "" && in.EncodingFormat != "float" && in.EncodingFormat != "base64" {
		e.fail(w, openai.NewError(http.StatusBadRequest, "'encoding_format' must be float or base64, got %q", in.EncodingFormat).WithParam("encoding_format"))
		return
	}
	var inputs [][]int
	if in.Messages != nil {
		text, err := tokenizer.Render(in.Messages, tokenizer.ChatTemplate{AddGenerationPrompt: true})
		if err != nil {
			e.fail(w, openai.NewError(http.StatusBadRequest, "%v", err).WithParam("messages"))
			return
		}
		inputs = append(inputs, text.IDs(e.cfg.MMTokens))
	} else if len(bytes.TrimSpace(in.Input)) == 0 || bytes.Equal(bytes.TrimSpace(in.Input), []byte("null")) {
		e.fail(w, openai.NewError(http.StatusBadRequest, "'input' is required").WithParam("input"))
		return
	} else {
		ps, err := openai.ParsePrompts(in.Input)
		if err != nil {
			e.fail(w, openai.NewError(http.StatusBadRequest, "%v", err).WithParam("input"))
			return
		}
		for _, p := range ps {
			if p.Tokens != nil {
				inputs = append(inputs, p.Tokens)
			} else {
				inputs = append(inputs, tokenizer.TextIDs(p.Text))
			}
		}
	}
	resp := embeddingResponse{Object: openai.ObjectList, Created: time.Now().Unix(), Model: tgt.name}
	for i, ids := range inputs {
		if len(ids) > e.cfg.MaxModelLen {
			e.fail(w, openai.NewError(http.StatusBadRequest,
				"This model's maximum context length is %d tokens. However, you requested %d tokens in the input for embedding generation. Please reduce the length of the input.",
				e.cfg.MaxModelLen, len(ids)).WithParam("input_tokens"))
			return
		}
		vec := tokenizer.Model{Seed: e.cfg.Seed}.Embed(tokenizer.PromptOf(ids, tgt.adapter, false).Digest, dim)
		// Floats as vLLM writes them: float32 values printed as doubles.
		floats := make([]float64, len(vec))
		for k, x := range vec {
			floats[k] = float64(x)
		}
		var emb any = floats
		if in.EncodingFormat == "base64" {
			buf := make([]byte, 4*len(vec))
			for k, x := range vec {
				binary.LittleEndian.PutUint32(buf[4*k:], math.Float32bits(x))
			}
			emb = base64.StdEncoding.EncodeToString(buf)
		}
		resp.Data = append(resp.Data, embeddingData{Index: i, Object: "embedding", Embedding: emb})
		resp.Usage.PromptTokens += len(ids)
	}
	resp.Usage.TotalTokens = resp.Usage.PromptTokens
	baseID := r.Header.Get("X-Request-Id")
	if baseID == "" {
		baseID = in.RequestID
	}
	if baseID == "" {
		baseID = randomHex(16)
	}
	resp.ID = "embd-" + baseID
	e.stats.promptTokens.Add(int64(resp.Usage.PromptTokens))
	writeJSON(w, http.StatusOK, resp)
}
