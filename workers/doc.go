// Package workers holds the two stage handlers, the last stop of the
// request flow (gateway, dispatcher, workers).
//
// The prefill handler calls a prefill engine with the client's body plus
// kv_transfer_params {do_remote_decode: true}, max_tokens 1 and stream
// false, and hands the kv_transfer_params it returns to the decode stage as
// opaque JSON. The decode handler calls a decode engine with the client's
// body plus those params, unchanged, and relays the engine's SSE events to
// the gateway. Both legs carry the request id as X-Request-Id: vLLM before
// connector v2 matched the two legs by it, and a mismatch crashed the
// decode engine.
package workers
