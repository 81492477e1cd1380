// Package workers holds the two stage handlers: the prefill worker calls a
// vLLM prefill engine with do_remote_decode and publishes the
// kv_transfer_params it returns; the decode worker calls a decode engine
// with those params, unchanged, under the same X-Request-Id, and relays the
// tokens to the gateway.
//
// It is the last stop of the request flow (gateway, dispatcher, workers)
// and arrives with the P/D pipeline (issue #3). Until then, pkg/sim is the
// engine these handlers will be tested against.
package workers
