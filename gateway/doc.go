// Package gateway is pdq's front door, and where to start reading the
// request flow. It speaks the OpenAI API over echo/v4: it checks each
// request and its X-Request-Id, drops any kv_transfer_params the client
// sent, picks the model's pool from the worker registry, decides P/D or
// decode-only, submits the job through package dispatcher, and relays the
// numbered reply chunks to the client, flushed one SSE event at a time.
//
// Next in the flow: package dispatcher, then package workers.
package gateway
