package verdict

import (
	"errors"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// Failure classifies a handler's error for the settle table: a handler
// wraps its error with one of Permanent, Rejected, Retryable, HandBack,
// Unread or Reported, and Decide reads it back.
type Failure struct {
	Err error
	// Permanent failures go to the client at once; others are retried on
	// a later delivery, possibly on another worker, until the stage's
	// MaxDeliver.
	Permanent bool
	// Reported means the handler already ended the client's reply (an
	// in-stream error); the loop sends nothing more.
	Reported bool
	// Client is what the client gets when this failure is the last word.
	// A 4xx is the client's own mistake: it is answered and recorded, not
	// dead-lettered.
	Client *openai.Error
	// Rejected means the engine refused the request before running it, so
	// a handoff's KV blocks were never read and must be released.
	Rejected bool
	// HandBack means the job never reached an engine: it goes back to the
	// queue for another worker, as the same generation, with no delivery
	// counted against it.
	HandBack bool
	// Unread means a decode engine never ran the request: a handoff's KV
	// was not read, and is released when the request goes back to
	// prefill.
	Unread bool
}

func (f *Failure) Error() string { return f.Err.Error() }
func (f *Failure) Unwrap() error { return f.Err }

// Permanent marks err as not worth retrying; client is what the client
// gets.
func Permanent(err error, client *openai.Error) error {
	return &Failure{Err: err, Permanent: true, Client: client}
}

// Rejected marks err as the engine's refusal of the request (its 4xx):
// permanent, the client's, and the engine never ran it.
func Rejected(err error, client *openai.Error) error {
	return &Failure{Err: err, Permanent: true, Client: client, Rejected: true}
}

// Retryable marks err as transient; client is what the client gets if no
// attempt succeeds.
func Retryable(err error, client *openai.Error) error {
	return &Failure{Err: err, Client: client}
}

// HandBack returns a job that never reached this worker's engine to the
// queue for another worker (one whose engine is healthy); client is what
// the client gets if it can go nowhere.
func HandBack(err error, client *openai.Error) error {
	return &Failure{Err: err, Client: client, HandBack: true}
}

// Unread marks err, a decode's failure, as one whose engine never ran the
// request (it refused the connection, or answered before running it), so
// that the handoff's KV, unread, is released when the request goes back
// to prefill.
func Unread(err error) error {
	var f *Failure
	if !errors.As(err, &f) {
		return &Failure{Err: err, Unread: true}
	}
	unread := *f
	unread.Unread = true
	return &unread
}

// Reported marks err as already told to the client.
func Reported(err error) error {
	return &Failure{Err: err, Permanent: true, Reported: true}
}
