package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
)

// Error is the body of an OpenAI error envelope. vLLM (since v0.10.1) and
// OpenAI both use this shape; Code carries the HTTP status, as vLLM does.
type Error struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// ErrorResponse is the envelope {"error": {...}} written for a failed request
// and, inside an SSE stream, as the data of an in-stream error event.
type ErrorResponse struct {
	Error *Error `json:"error"`
}

// NewError builds an error with the type name that goes with status, so that
// clients which map types to exception classes (the official SDKs) see the
// class they expect.
func NewError(status int, format string, args ...any) *Error {
	return &Error{Message: fmt.Sprintf(format, args...), Type: ErrorType(status), Code: status}
}

// WithParam returns a copy of e that names the request field at fault.
func (e *Error) WithParam(param string) *Error {
	c := *e
	c.Param = &param
	return &c
}

// Error implements error.
func (e *Error) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Code, e.Type, e.Message)
}

// Status is the HTTP status to answer with, 500 when Code is not one.
func (e *Error) Status() int {
	if e.Code < 400 || e.Code > 599 {
		return http.StatusInternalServerError
	}
	return e.Code
}

// ErrorType names the error class for an HTTP status, after the exception
// names of the OpenAI SDKs that vLLM also uses.
func ErrorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusUnauthorized:
		return "AuthenticationError"
	case http.StatusForbidden:
		return "PermissionDeniedError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusConflict:
		return "ConflictError"
	case http.StatusRequestEntityTooLarge:
		return "RequestTooLargeError"
	case http.StatusUnprocessableEntity:
		return "UnprocessableEntityError"
	case http.StatusTooManyRequests:
		return "RateLimitError"
	case http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case http.StatusGatewayTimeout:
		return "GatewayTimeoutError"
	}
	if status >= 500 {
		return "InternalServerError"
	}
	return "BadRequestError"
}

// Envelope is the error's JSON body, {"error":{...}}, with <, > and &
// written as they are, as vLLM (Python's json) writes them.
func (e *Error) Envelope() ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(ErrorResponse{Error: e}); err != nil {
		return nil, fmt.Errorf("encode error envelope: %w", err)
	}
	return bytes.TrimRight(b.Bytes(), "\n"), nil
}

// WriteError answers a request with e as a JSON error envelope.
func WriteError(w http.ResponseWriter, e *Error) error {
	body, err := e.Envelope()
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.Status())
	if _, err := w.Write(body); err != nil {
		return fmt.Errorf("write error envelope: %w", err)
	}
	return nil
}

// ParseError reads an error envelope from a response body. It understands
// the current envelope and the flat {"object":"error","message":...} shape of
// vLLM before v0.10.1; ok is false when body is neither.
func ParseError(body []byte) (e *Error, ok bool) {
	var env struct {
		Error   json.RawMessage `json:"error"`
		Object  string          `json:"object"`
		Message string          `json:"message"`
		Type    string          `json:"type"`
		Code    int             `json:"code"`
	}
	if json.Unmarshal(body, &env) != nil {
		return nil, false
	}
	if len(env.Error) > 0 {
		var inner Error
		if json.Unmarshal(env.Error, &inner) == nil && inner.Message != "" {
			return &inner, true
		}
		var s string
		if json.Unmarshal(env.Error, &s) == nil && s != "" {
			return &Error{Message: s}, true
		}
	}
	if env.Object == "error" && env.Message != "" {
		return &Error{Message: env.Message, Type: env.Type, Code: env.Code}, true
	}
	return nil, false
}
