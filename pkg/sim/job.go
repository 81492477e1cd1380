package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/sched"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// mode is the part a request asks the engine to play in a P/D pair.
type mode int

const (
	modeLocal   mode = iota // no kv_transfer_params: prefill and decode here
	modePrefill             // do_remote_decode: prefill, then hold the blocks
	modeDecode              // do_remote_prefill: read the blocks, then decode
)

func (m mode) String() string {
	switch m {
	case modePrefill:
		return "prefill"
	case modeDecode:
		return "decode"
	}
	return "local"
}

// remote is what a decode request's kv_transfer_params say of the prefill.
type remote struct {
	engineID  string
	requestID string
	host      string
	port      int
	blockIDs  []int
	tpSize    int
}

func (r remote) addr() string { return net.JoinHostPort(r.host, strconv.Itoa(r.port)) }

// job is one engine request of a parsed, validated generation request:
// one prompt. A completions request with a batch of prompts is one job per
// prompt, as vLLM makes one engine request per prompt.
type job struct {
	endpoint openai.Endpoint
	req      *openai.Request
	// index is the prompt's place in the batch (0 for chat).
	index int
	// baseID is the request id as vLLM takes it: X-Request-Id, else the
	// body's request_id, else random.
	baseID string
	// respID is the response id, chatcmpl-<base> or cmpl-<base>.
	respID string
	// internalID is the engine's id: respID (plus -<index> for
	// completions), plus a random suffix in v2, as vLLM 0.14+ adds one.
	internalID string
	// target is the model or adapter that answers; gen says its words.
	target target
	gen    tokenizer.Model
	prompt tokenizer.Prompt
	// hashes name the prompt's full KV blocks (batched engines only).
	hashes    []uint64
	maxTokens int
	minTokens int
	mode      mode
	remote    remote
	created   int64
	start     time.Time
	log       *slog.Logger

	// In a batch sent with do_remote_prefill, every prompt carries the
	// same kv_transfer_params and reads the same blocks, one after the
	// other: loadAfter is closed once the previous prompt's read is done,
	// and loaded once this one's is.
	loadAfter  <-chan struct{}
	loaded     chan struct{}
	loadedOnce sync.Once
}

// markLoaded lets the next prompt of a decode batch read.
func (j *job) markLoaded() {
	if j.loaded != nil {
		j.loadedOnce.Do(func() { close(j.loaded) })
	}
}

// waitLoadAfter waits until the previous prompt of a decode batch has
// read its KV (at once for any other job), or ctx ends.
func (j *job) waitLoadAfter(ctx context.Context) error {
	if j.loadAfter == nil {
		return nil
	}
	select {
	case <-j.loadAfter:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// parse reads and checks a request, answering as vLLM would: 404 for
// another model, 400 for anything else wrong. It returns one job per
// prompt.
func (e *Engine) parse(endpoint openai.Endpoint, r *http.Request, body []byte) ([]*job, *openai.Error) {
	req, apiErr := openai.DecodeRequest(endpoint, body)
	if apiErr != nil && apiErr.Param != nil && *apiErr.Param == "model" {
		// No model named: looked at only then, so that a request that
		// names one costs no more.
		if withModel, ok := withServedModel(body, e.names.served[0]); ok {
			req, apiErr = openai.DecodeRequest(endpoint, withModel)
		}
	}
	if apiErr != nil {
		return nil, apiErr
	}
	tgt, ok := e.names.resolve(req.Model)
	if !ok {
		return nil, unknownModel(req.Model)
	}
	if req.N != nil && *req.N > 1 {
		return nil, openai.NewError(http.StatusBadRequest, "pdq sim supports n=1 only, got n=%d", *req.N).WithParam("n")
	}
	if req.Priority != 0 && e.cfg.SchedulingPolicy != sched.Priority {
		// vLLM's processor refuses it so (a ValueError: 400).
		return nil, openai.NewError(http.StatusBadRequest, "Got priority %d but Priority scheduling is not enabled.", req.Priority).WithParam("priority")
	}
	var prompts []tokenizer.Prompt
	var ids [][]int // each prompt's token ids, for the block hashes
	switch endpoint {
	case openai.Chat:
		tmpl := tokenizer.ChatTemplate{AddGenerationPrompt: req.AddGenerationPrompt == nil || *req.AddGenerationPrompt,
			ContinueFinalMessage: req.ContinueFinalMessage != nil && *req.ContinueFinalMessage}
		if tmpl.AddGenerationPrompt && tmpl.ContinueFinalMessage {
			// vLLM's own message.
			return nil, openai.NewError(http.StatusBadRequest,
				"Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
		}
		if tmpl.ContinueFinalMessage && (len(req.Messages) == 0 || req.Messages[len(req.Messages)-1].Role != "assistant") {
			return nil, openai.NewError(http.StatusBadRequest,
				"continue_final_message is set but the final message is not the assistant's").WithParam("messages")
		}
		text, err := tokenizer.Render(req.Messages, tmpl)
		if err != nil {
			return nil, openai.NewError(http.StatusBadRequest, "%v", err).WithParam("messages")
		}
		promptIDs := text.IDs(e.cfg.MMTokens)
		ids = append(ids, promptIDs)
		prompts = append(prompts, tokenizer.PromptOf(promptIDs, tgt.adapter, text.MidWord()))
	case openai.Completions:
		for _, p := range req.Prompts() { // parsed, and judged, by DecodeRequest
			if p.Tokens != nil {
				ids = append(ids, p.Tokens)
				prompts = append(prompts, tokenizer.PromptOf(p.Tokens, tgt.adapter, false))
			} else {
				promptIDs := tokenizer.TextIDs(p.Text)
				ids = append(ids, promptIDs)
				prompts = append(prompts, tokenizer.PromptOf(promptIDs, tgt.adapter, tokenizer.EndsMidWord(p.Text)))
			}
		}
	}
	// vLLM checks each prompt in turn and fails the request on the first
	// that does not fit.
	maxLen := e.cfg.MaxModelLen
	limits := make([][2]int, len(prompts)) // max and min tokens per prompt
	for i, p := range prompts {
		if p.Tokens == 0 {
			return nil, openai.NewError(http.StatusBadRequest, "The prompt must not be empty.").WithParam("prompt")
		}
		if e.cfg.LegacyLengthErrors {
			n, ok := req.OutputLimit(endpoint)
			if !ok {
				n = max(maxLen-p.Tokens, 1)
			}
			if p.Tokens+n > maxLen {
				// vLLM before 0.10 (serving_engine.py _validate_input):
				// one check of prompt plus output.
				return nil, openai.NewError(http.StatusBadRequest,
					"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
					maxLen, p.Tokens+n, p.Tokens, n)
			}
		}
		if p.Tokens >= maxLen {
			return nil, openai.NewError(http.StatusBadRequest,
				"This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the input messages.",
				maxLen, p.Tokens)
		}
		room := maxLen - p.Tokens
		limits[i][0] = room
		if n, ok := req.OutputLimit(endpoint); ok {
			if n > room {
				return nil, openai.NewError(http.StatusBadRequest,
					"'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum context length is %d tokens and your request has %d input tokens (%d > %d - %d).",
					n, maxLen, p.Tokens, n, maxLen, p.Tokens).WithParam("max_tokens")
			}
			limits[i][0] = n
		}
		if req.MinTokens != nil {
			if *req.MinTokens > limits[i][0] {
				return nil, openai.NewError(http.StatusBadRequest,
					"min_tokens must be less than or equal to max_tokens=%d, got %d.", limits[i][0], *req.MinTokens).WithParam("min_tokens")
			}
			limits[i][1] = *req.MinTokens
		}
	}
	md, rem, err := e.parseKVParams(req.KVTransferParams)
	if err != nil {
		return nil, err
	}
	if md == modePrefill && req.Stream {
		return nil, openai.NewError(http.StatusBadRequest,
			"kv_transfer_params.do_remote_decode requires stream=false: a streamed response cannot return kv_transfer_params").WithParam("stream")
	}

	baseID := r.Header.Get("X-Request-Id")
	if baseID == "" {
		baseID = req.RequestID
	}
	if baseID == "" {
		baseID = randomHex(16)
	}
	respID := endpoint.IDPrefix() + baseID
	now := time.Now()
	gen := e.modelFor(tgt)
	jobs := make([]*job, len(prompts))
	for i, p := range prompts {
		j := &job{endpoint: endpoint, req: req, index: i, baseID: baseID, respID: respID, internalID: respID,
			target: tgt, gen: gen, prompt: p, maxTokens: limits[i][0], minTokens: limits[i][1],
			mode: md, remote: rem, created: now.Unix(), start: now}
		if endpoint == openai.Completions {
			j.internalID += "-" + strconv.Itoa(i) // vLLM's cmpl-<base>-<i>
		}
		if e.cfg.Protocol == simconfig.ProtocolV2 {
			j.internalID += "-" + randomHex(4)
		}
		if md == modeDecode && len(prompts) > 1 {
			j.loaded = make(chan struct{})
			if i > 0 {
				j.loadAfter = jobs[i-1].loaded
			}
		}
		if e.batch != nil {
			j.hashes = tokenizer.BlockHashes(ids[i], tgt.adapter, e.cfg.BlockSize)
		}
		j.log = e.log.With(logging.KeyRequestID, j.internalID, "mode", md.String())
		if tgt.adapter != "" {
			j.log = j.log.With("lora", tgt.adapter)
		}
		jobs[i] = j
	}
	return jobs, nil
}

// withServedModel is body with model set to served when it names none
// (absent, null or ""), and whether it did: vLLM takes such a request as
// one for its first served name (engine/serving.py _is_model_supported:
// "if not model_name: return True"; models.model_name(None) is
// base_model_paths[0].name). pdq's request decoder wants a model, so the
// sim gives it that one.
func withServedModel(body []byte, served string) ([]byte, bool) {
	v, ok, err := jsonobj.Get(body, "model")
	if err != nil || ok && string(v) != "null" && string(v) != `""` {
		return body, false
	}
	out, err := jsonobj.Edit(body, jsonobj.Set("model", jsonobj.AppendString(nil, served)))
	return out, err == nil
}

// kvParams is kv_transfer_params as the engine reads them. Pointers tell a
// missing key from a zero value.
type kvParams struct {
	DoRemoteDecode  *bool           `json:"do_remote_decode"`
	DoRemotePrefill *bool           `json:"do_remote_prefill"`
	RemoteEngineID  *string         `json:"remote_engine_id"`
	RemoteRequestID *string         `json:"remote_request_id"`
	RemoteHost      *string         `json:"remote_host"`
	RemotePort      *int            `json:"remote_port"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	TPSize          *int            `json:"tp_size"`
}

// parseKVParams decides the request's mode. Params a decode engine cannot
// use get a 400 that names the missing keys, where vLLM would hang or
// assert.
func (e *Engine) parseKVParams(raw json.RawMessage) (mode, remote, *openai.Error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return modeLocal, remote{}, nil
	}
	bad := func(format string, args ...any) (mode, remote, *openai.Error) {
		return modeLocal, remote{}, openai.NewError(http.StatusBadRequest, "invalid kv_transfer_params: "+format, args...).WithParam("kv_transfer_params")
	}
	var p kvParams
	if err := json.Unmarshal(raw, &p); err != nil {
		return bad("%v", err)
	}
	decode, prefill := p.DoRemoteDecode != nil && *p.DoRemoteDecode, p.DoRemotePrefill != nil && *p.DoRemotePrefill
	switch {
	case decode && prefill:
		return bad("do_remote_decode and do_remote_prefill are both true")
	case decode:
		return modePrefill, remote{}, nil
	case !prefill:
		return modeLocal, remote{}, nil
	}
	var missing []string
	str := func(key string, v *string) string {
		if v == nil || *v == "" {
			missing = append(missing, key)
			return ""
		}
		return *v
	}
	rem := remote{tpSize: 1}
	rem.engineID = str("remote_engine_id", p.RemoteEngineID)
	rem.host = str("remote_host", p.RemoteHost)
	if e.cfg.Protocol == simconfig.ProtocolV2 {
		rem.requestID = str("remote_request_id", p.RemoteRequestID)
	}
	if p.RemotePort == nil || *p.RemotePort <= 0 || *p.RemotePort > 65535 {
		missing = append(missing, "remote_port")
	} else {
		rem.port = *p.RemotePort
	}
	ids, err := parseBlockIDs(p.RemoteBlockIDs)
	if err != nil {
		return bad("remote_block_ids: %v", err)
	}
	if len(ids) == 0 {
		missing = append(missing, "remote_block_ids")
	}
	rem.blockIDs = ids
	if p.TPSize != nil {
		rem.tpSize = *p.TPSize
	}
	if len(missing) > 0 {
		return bad("do_remote_prefill is set but these keys are missing or empty: %v", missing)
	}
	return modeDecode, rem, nil
}

// parseBlockIDs reads remote_block_ids as a list of ints, or as a list of
// lists (one per KV-cache group, as newer vLLM sends), flattened.
func parseBlockIDs(raw json.RawMessage) ([]int, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, nil
	}
	var ids []int
	if err := json.Unmarshal(raw, &ids); err == nil {
		return ids, nil
	}
	var groups [][]int
	if err := json.Unmarshal(raw, &groups); err != nil {
		return nil, fmt.Errorf("want a list of integers (or of lists of integers), got %s", truncate(raw, 64))
	}
	var flat []int // not ids: a failed Unmarshal may have filled it in part
	for _, g := range groups {
		flat = append(flat, g...)
	}
	return flat, nil
}

func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "..."
}

// numBlocks is the number of KV blocks a prompt fills.
func (e *Engine) numBlocks(tokens int) int {
	return (tokens + e.cfg.BlockSize - 1) / e.cfg.BlockSize
}

// kvParamsOut is what a prefill returns, in vLLM's key order.
type kvParamsOut struct {
	DoRemotePrefill bool   `json:"do_remote_prefill"`
	DoRemoteDecode  bool   `json:"do_remote_decode"`
	RemoteBlockIDs  []int  `json:"remote_block_ids"`
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteRequestID string `json:"remote_request_id,omitempty"`
	RemoteHost      string `json:"remote_host"`
	RemotePort      int    `json:"remote_port"`
	TPSize          int    `json:"tp_size"`
}

func (e *Engine) paramsFor(j *job, blocks []int) (json.RawMessage, error) {
	out := kvParamsOut{
		DoRemotePrefill: true,
		RemoteBlockIDs:  blocks,
		RemoteEngineID:  e.engineID,
		RemoteHost:      e.cfg.KVHost,
		RemotePort:      e.KVPort(),
		TPSize:          1,
	}
	if e.cfg.Protocol == simconfig.ProtocolV2 {
		out.RemoteRequestID = j.internalID // v1 engines predate the key
	}
	b, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("encode kv_transfer_params: %w", err)
	}
	return b, nil
}
