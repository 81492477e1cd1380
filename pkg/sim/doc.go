// Package sim is pdq's stand-in for a vLLM engine with the NIXL KV
// connector: an OpenAI-compatible server that plays the prefill leg, the
// decode leg, or a plain engine, with vLLM's wire format, ids, errors and
// latencies (simulated with real sleeps).
//
// It is the test oracle for the P/D handshake, so it fails the way vLLM
// fails when a router gets the handshake wrong: a prefill holds its KV
// blocks until a decode engine reads them over the side channel or a lease
// runs out; a decode engine reads them by remote_request_id (protocol v2)
// or by its own request id (v1, where two X-Request-Ids kill the engine);
// a KV load failure fails the request or recomputes it; blocks of another
// prompt silently give another prompt's answer. Every such event is
// counted in [Stats], served at GET /sim/stats.
//
// The generated text is a deterministic function of the seed and the KV
// cache the tokens are decoded from, so a correct P/D run says exactly
// what a plain run of the same prompt says. The KV cache stands for the
// prompt's token ids, images included, and the LoRA adapter, so a decode
// given the blocks of another prompt, image or adapter is caught.
//
// # Models
//
// --model is the model the engine runs; --served-model-name (comma-
// separated or repeated) gives the names it answers to, and responses
// carry the first. --lora-modules name=path (or vLLM's JSON form, with
// base_model_name) loads adapters; a request naming one is answered under
// its name, in other words than the base model's. With
// --allow-runtime-lora-updating (the default here; vLLM needs
// VLLM_ALLOW_RUNTIME_LORA_UPDATING) POST /v1/load_lora_adapter
// {"lora_name","lora_path","load_inplace"} and /v1/unload_lora_adapter
// {"lora_name"} change them at run time, answering vLLM's plain-text
// "Success: ..." or its errors. GET /v1/models lists the served names
// (root --model, parent null, max_model_len), then the adapters (root
// their path, parent their base model, max_model_len null), each with
// one model_permission object.
//
// # Prompts
//
// Chat messages may hold image_url, input_image, image_embeds, audio_url,
// input_audio, audio_embeds, video_url and video_embeds parts: each counts
// --mm-tokens prompt tokens (default 16: one KV block of the default block
// size, small enough to leave max-model-len checks about the text) and is
// rendered as "<image>", "<audio>" or "<video>" on a line before the
// message's text. Its content (URL, data, or uuid) feeds the prompt's
// token ids. Another part type is vLLM's 400 "Unknown part type: ...".
//
// A completions prompt may be a batch (a list of strings or of token-id
// lists): one engine request per prompt (cmpl-<id>-<i>), one choice per
// prompt with index i, usage summed, streamed chunks interleaved under one
// id. As in vLLM, a prefill returns the kv_transfer_params of prompt 0
// only (the others' blocks wait for their lease), and a decode given them
// runs every prompt with them: prompt 0 reads its blocks, the others find
// none and fail or recompute under --kv-load-failure.
//
// # Other routes
//
// POST /tokenize {"model","prompt"} or {"model","messages",...} answers
// {"count","max_model_len","tokens","token_strs"} with the ids of the
// tokens the engine counts (see [CountTokens]); POST /detokenize
// {"model","tokens"} answers {"prompt"}. GET /version answers
// {"version"} (--vllm-version). --runner pooling serves POST
// /v1/embeddings with deterministic unit vectors (--embedding-dim long)
// instead of chat and completions; a generative engine answers
// /v1/embeddings 404 {"detail":"Not Found"}, as vLLM does for a route it
// did not register. --api-key guards /v1 only, as vLLM's middleware did.
//
// GET /sim/requests?id=X returns what reached the engine under
// X-Request-Id X, bodies byte for byte, in arrival order; without id, the
// last 64 requests without bodies. See [RecordedRequests].
package sim
