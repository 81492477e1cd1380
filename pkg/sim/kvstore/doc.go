// Package kvstore is a simulated prefill engine's KV blocks held for
// remote decodes: allocated when a prefill finishes, read once by a decode
// engine over the side channel, freed then or when their lease runs out,
// as vLLM's NIXL connector holds them.
package kvstore
