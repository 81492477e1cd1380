package openai

import "encoding/json"

// Usage counts the tokens of a request.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	// PromptTokensDetails is set by vLLM with --enable-prompt-tokens-details
	// when some prompt tokens were not computed.
	PromptTokensDetails *PromptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// PromptTokensDetails is vLLM's PromptTokenUsageInfo.
type PromptTokensDetails struct {
	// CachedTokens were found in the prefix cache or read from a prefill
	// engine (vLLM's num_cached_tokens).
	CachedTokens int `json:"cached_tokens"`
}

// NewUsage fills in the total.
func NewUsage(prompt, completion int) *Usage {
	return &Usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion}
}

// ChatCompletion is a non-streaming chat response in vLLM's shape. A prefill
// engine puts its kv_transfer_params here, at the top level.
type ChatCompletion struct {
	ID               string          `json:"id"`
	Object           string          `json:"object"`
	Created          int64           `json:"created"`
	Model            string          `json:"model"`
	Choices          []ChatChoice    `json:"choices"`
	Usage            *Usage          `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

// ChatChoice is one choice of a ChatCompletion.
type ChatChoice struct {
	Index        int         `json:"index"`
	Message      ChatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
	StopReason   any         `json:"stop_reason"`
}

// ChatMessage is the assistant message of a choice.
type ChatMessage struct {
	Role      string `json:"role"`
	Content   string `json:"content"`
	ToolCalls []any  `json:"tool_calls"`
}

// ChatChunk is one SSE event of a streaming chat response.
type ChatChunk struct {
	ID      string            `json:"id"`
	Object  string            `json:"object"`
	Created int64             `json:"created"`
	Model   string            `json:"model"`
	Choices []ChatChunkChoice `json:"choices"`
	Usage   *Usage            `json:"usage,omitempty"`
}

// ChatChunkChoice is the per-choice part of a ChatChunk. FinishReason is
// null until the last token.
type ChatChunkChoice struct {
	Index        int       `json:"index"`
	Delta        ChatDelta `json:"delta"`
	Logprobs     any       `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
	// StopReason is set (often to null) on the last chunk only.
	StopReason json.RawMessage `json:"stop_reason,omitempty"`
}

// ChatDelta is the new part of the message. The first chunk of a choice
// carries the role and empty content.
type ChatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

// Completion is a non-streaming completions response in vLLM's shape.
type Completion struct {
	ID               string             `json:"id"`
	Object           string             `json:"object"`
	Created          int64              `json:"created"`
	Model            string             `json:"model"`
	Choices          []CompletionChoice `json:"choices"`
	Usage            *Usage             `json:"usage"`
	KVTransferParams json.RawMessage    `json:"kv_transfer_params"`
}

// CompletionChoice is one choice of a Completion, and of a streaming
// completions chunk (where FinishReason is null until the last token).
type CompletionChoice struct {
	Index        int     `json:"index"`
	Text         string  `json:"text"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
	StopReason   any     `json:"stop_reason"`
}

// CompletionChunk is one SSE event of a streaming completions response.
type CompletionChunk struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []CompletionChoice `json:"choices"`
	Usage   *Usage             `json:"usage,omitempty"`
}

// Model is one entry of GET /v1/models.
type Model struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	Root        string `json:"root,omitempty"`
	Parent      any    `json:"parent"`
	MaxModelLen int    `json:"max_model_len,omitempty"`
	Permission  []any  `json:"permission"`
}

// ModelList is the body of GET /v1/models.
type ModelList struct {
	Object string  `json:"object"`
	Data   []Model `json:"data"`
}

// Object names used in responses.
const (
	ObjectChatCompletion      = "chat.completion"
	ObjectChatCompletionChunk = "chat.completion.chunk"
	ObjectTextCompletion      = "text_completion"
	ObjectList                = "list"
	ObjectModel               = "model"
)

// Finish reasons.
const (
	FinishStop   = "stop"
	FinishLength = "length"
	FinishError  = "error"
)
