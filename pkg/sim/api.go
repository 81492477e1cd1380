package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"

	"github.com/pdq-dev/pdq/pkg/openai"
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
	if in.Model != nil {
		if _, ok := e.names.resolve(*in.Model); !ok {
			openai.WriteError(w, unknownModel(*in.Model))
			return
		}
	}
	var ids []int
	switch {
	case in.Messages != nil:
		tmpl := ChatTemplate{AddGenerationPrompt: in.AddGenerationPrompt == nil || *in.AddGenerationPrompt,
			ContinueFinalMessage: in.ContinueFinalMessage}
		if tmpl.AddGenerationPrompt && tmpl.ContinueFinalMessage {
			openai.WriteError(w, openai.NewError(http.StatusBadRequest,
				"Cannot set both `continue_final_message` and `add_generation_prompt` to True."))
			return
		}
		text, err := renderChat(in.Messages, tmpl)
		if err != nil {
			openai.WriteError(w, openai.NewError(http.StatusBadRequest, "%v", err).WithParam("messages"))
			return
		}
		ids = text.ids(e.cfg.MMTokens)
	case in.Prompt != nil:
		ids = textIDs(*in.Prompt)
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
			resp.TokenStrs[i], _ = tokenString(id)
		}
	}
	writeJSON(w, http.StatusOK, resp)
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
	if in.Model != nil {
		if _, ok := e.names.resolve(*in.Model); !ok {
			openai.WriteError(w, unknownModel(*in.Model))
			return
		}
	}
	if in.Tokens == nil {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "'tokens' is required").WithParam("tokens"))
		return
	}
	text, err := decodeIDs(*in.Tokens)
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
