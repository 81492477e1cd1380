// Package gateway is pdq's front door, and where to start reading the
// request flow: an echo/v4 HTTP server that speaks the OpenAI API, checks
// each request and its X-Request-Id, submits it as a job to JetStream
// through the dispatcher, and relays the reply stream to the client.
//
// Next in the flow: package dispatcher, then package workers. The server
// itself arrives with the P/D pipeline (issue #3); see
// ../shared/docs/architecture.md for the design it follows.
package gateway
