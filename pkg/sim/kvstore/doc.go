// Package kvstore is a simulated prefill engine's KV blocks held for
// remote decodes: allocated when a prefill finishes, read once by a decode
// engine over the side channel, freed then or when their lease runs out,
// as vLLM's NIXL connector holds them. It also holds the side channel's
// protocol, the NIXL stand-in (sidechannel.go): its messages, the codes
// of its refusals, and the client a decode engine reads and frees blocks
// with. The server, which answers from a Store, is the engine's (package
// sim).
package kvstore
