// Package openai holds the pieces of the OpenAI HTTP API that pdq reads and
// writes: the request fields it looks at, vLLM's response shapes, the error
// envelope, and Server-Sent Events in both directions.
//
// Bodies pdq merely passes on stay raw bytes; these types are for the fields
// a component must understand, so that nothing a client or an engine sends
// is lost by a decode and re-encode.
package openai
