package dispatcher

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// Job is the envelope of a request on its way through the stages. The
// client's body and the engine's kv_transfer_params are opaque bytes: pdq
// passes them on, it does not re-encode them.
type Job struct {
	// ID is the request id: the subject token, the Nats-Msg-Id, and the
	// X-Request-Id of both engine calls.
	ID       string          `json:"id"`
	Model    string          `json:"model"`
	Pool     string          `json:"pool"`
	Endpoint openai.Endpoint `json:"endpoint"`
	// Stream is the client's stream flag; the decode call keeps it.
	Stream bool `json:"stream"`
	// Body is the client's request body, without any kv_transfer_params.
	Body json.RawMessage `json:"body"`
	// ReplyTo is the gateway's reply subject for this request.
	ReplyTo string `json:"reply_to"`
	// PromptTokens is the gateway's estimate, which chose P/D or decode-only.
	PromptTokens int       `json:"prompt_tokens_estimate"`
	SubmittedAt  time.Time `json:"submitted_at"`

	// KVTransferParams is set by the prefill stage: the prefill engine's
	// params, for the decode engine, unchanged but for remote_host.
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
	// Prefill records the prefill stage, once it has run.
	Prefill *StageRecord `json:"prefill,omitempty"`
}

// StageRecord says where and when a stage ran.
type StageRecord struct {
	Worker   string        `json:"worker"`
	Engine   string        `json:"engine"`
	Attempt  int           `json:"attempt"`
	Started  time.Time     `json:"started"`
	Duration time.Duration `json:"duration_ns"`
}

// Validate checks the fields every stage relies on.
func (j *Job) Validate() error {
	switch {
	case !ValidRequestID(j.ID):
		return fmt.Errorf("job id %q is not a valid request id", j.ID)
	case j.Pool == "" || j.Model == "":
		return fmt.Errorf("job %s has no model or pool", j.ID)
	case j.Endpoint != openai.Chat && j.Endpoint != openai.Completions:
		return fmt.Errorf("job %s has unknown endpoint %q", j.ID, j.Endpoint)
	case len(j.Body) == 0:
		return fmt.Errorf("job %s has no body", j.ID)
	case j.ReplyTo == "":
		return fmt.Errorf("job %s has no reply subject", j.ID)
	}
	return nil
}

func decodeJob(data []byte) (*Job, error) {
	var j Job
	if err := json.Unmarshal(data, &j); err != nil {
		return nil, fmt.Errorf("decode job envelope: %w", err)
	}
	if err := j.Validate(); err != nil {
		return nil, err
	}
	return &j, nil
}

// Headers of pdq's messages.
const (
	// HeaderKind is the kind of a reply message: chunk, done or error.
	HeaderKind = "Pdq-Kind"
	// HeaderSeq numbers the chunks of one attempt from 0; on done it is the
	// number of chunks sent.
	HeaderSeq = "Pdq-Seq"
	// HeaderAttempt is the decode attempt a reply belongs to (0 for errors
	// from the prefill stage). A redelivered decode starts over with a new
	// attempt.
	HeaderAttempt = "Pdq-Attempt"
	// HeaderStatus is the HTTP status of an error reply.
	HeaderStatus = "Pdq-Status"
	// HeaderStage and HeaderReason label a dead letter.
	HeaderStage  = "Pdq-Stage"
	HeaderReason = "Pdq-Reason"
)

// Reply kinds.
const (
	KindChunk = "chunk"
	KindDone  = "done"
	KindError = "error"
)
