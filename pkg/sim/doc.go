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
// what a plain run of the same prompt says.
//
// GET /sim/requests?id=X returns what reached the engine under
// X-Request-Id X, bodies byte for byte, in arrival order; without id, the
// last 64 requests without bodies. See [RecordedRequests].
package sim
