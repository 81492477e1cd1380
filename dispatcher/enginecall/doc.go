// Package enginecall carries vLLM's endpoints other than generation
// (tokenize, detokenize, version, ...) from the gateway to one decode
// worker's engine over NATS request-reply: [Call] is the gateway's end,
// [Serve] the worker's, which bounds how many run at once.
package enginecall
