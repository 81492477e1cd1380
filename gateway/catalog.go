package gateway

import (
	"net/http"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// ClientError is one status a client may get from pdq instead of an
// answer, with its error type, the message a client most often reads with
// it, and when it comes. The README's status table
// and docs/reliability.md name these statuses and no others, and pdq's
// code makes no other (tests/catalog_test.go checks all three).
type ClientError struct {
	Status int
	// Type is the "type" of the error body (openai.ErrorType).
	Type string
	// Message is the error's most common message, as the code formats it
	// (%s, %d and %v stand for the details).
	Message string
	When    string
}

// ClientErrors is the catalog, by status. An engine's own 4xx refusal is
// passed through with its status (most often a 400), and is the client's
// to read, not pdq's to list.
func ClientErrors() []ClientError {
	list := []ClientError{
		{Status: http.StatusBadRequest, Message: "request body: %v", When: "the request cannot be run: malformed JSON, wrong types, a missing field, no model while several are served, a bad X-Request-Id; or the engine's own 400"},
		{Status: http.StatusUnauthorized, Message: "invalid or missing API key", When: "PDQ_API_KEYS is set and the bearer token is not one of them"},
		{Status: http.StatusNotFound, Message: "The model `%s` does not exist.", When: "no live worker serves the model, or no such request record"},
		{Status: http.StatusRequestTimeout, Message: "the request body did not arrive within %v", When: "the body did not arrive within PDQ_BODY_TIMEOUT"},
		{Status: http.StatusConflict, Message: "a request with this X-Request-Id is in flight or has been answered; use a new id", When: "a request with this X-Request-Id is in flight or has been answered"},
		{Status: http.StatusRequestEntityTooLarge, Message: "request body is larger than %d bytes", When: "the body is over the limit (7 MiB)"},
		{Status: http.StatusTooManyRequests, Message: "the queue is full; retry in %d s", When: "the pool's queue is full, or the tenant holds its share of it (PDQ_FAIR_QUEUE), or the gateway holds PDQ_MAX_INFLIGHT_BYTES; with Retry-After"},
		{Status: http.StatusInternalServerError, Message: "pdq's %s worker failed on this request", When: "pdq met a bug: a worker's handler panicked, a job could not be read; kept for replay"},
		{Status: http.StatusBadGateway, Message: "%s engine failed: %s", When: "an engine kept failing, or a stream broke after output and could not be moved; kept for replay"},
		{Status: http.StatusServiceUnavailable, Message: "pdq cannot reach its queue (NATS); retry", When: "no workers for the model, NATS out of reach or its disk full, a gateway shutting down; with Retry-After where a retry helps"},
		{Status: http.StatusGatewayTimeout, Message: "the request's deadline passed %s", When: "the request's deadline passed, or a running decode went silent for PDQ_STALL_TIMEOUT"},
	}
	for i := range list {
		list[i].Type = openai.ErrorType(list[i].Status)
	}
	return list
}
