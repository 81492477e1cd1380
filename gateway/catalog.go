package gateway

import (
	"net/http"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// ClientError is one status a client may get from pdq instead of an
// answer, with its error type and when it comes. The README's status table
// and docs/reliability.md name these statuses and no others, and pdq's
// code makes no other (tests/catalog_test.go checks all three).
type ClientError struct {
	Status int
	// Type is the "type" of the error body (openai.ErrorType).
	Type string
	When string
}

// ClientErrors is the catalog, by status. An engine's own 4xx refusal is
// passed through with its status (most often a 400), and is the client's
// to read, not pdq's to list.
func ClientErrors() []ClientError {
	list := []ClientError{
		{Status: http.StatusBadRequest, When: "the request cannot be run: malformed JSON, wrong types, a missing field, no model while several are served, a bad X-Request-Id; or the engine's own 400"},
		{Status: http.StatusUnauthorized, When: "PDQ_API_KEYS is set and the bearer token is not one of them"},
		{Status: http.StatusNotFound, When: "no live worker serves the model, or no such request record"},
		{Status: http.StatusRequestTimeout, When: "the body did not arrive within PDQ_BODY_TIMEOUT"},
		{Status: http.StatusConflict, When: "a request with this X-Request-Id is in flight or has been answered"},
		{Status: http.StatusRequestEntityTooLarge, When: "the body is over the limit (7 MiB)"},
		{Status: http.StatusTooManyRequests, When: "the pool's queue is full or the gateway holds PDQ_MAX_INFLIGHT_BYTES; with Retry-After"},
		{Status: http.StatusInternalServerError, When: "pdq met a bug: a worker's handler panicked, a job could not be read; kept for replay"},
		{Status: http.StatusBadGateway, When: "an engine kept failing, or a stream broke after output and could not be moved; kept for replay"},
		{Status: http.StatusServiceUnavailable, When: "no workers for the model, NATS out of reach or its disk full, a gateway shutting down; with Retry-After where a retry helps"},
		{Status: http.StatusGatewayTimeout, When: "the request's deadline passed, or a running decode went silent for PDQ_STALL_TIMEOUT"},
	}
	for i := range list {
		list[i].Type = openai.ErrorType(list[i].Status)
	}
	return list
}
