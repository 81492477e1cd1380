package stage

import (
	"context"
	"errors"
	"net/http"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// The settle table. Once its handler has returned, a delivery settles by
// one verdict: decide picks it from what the delivery is (its facts) and
// how the handler ended (its outcome), and settle.carry carries it out.
// What each verdict does to the message, the request's record, the
// client's answer, the handoff's KV and the dead-letter stream is in
// effects, in one place; TestSettleTable holds decide and effects to the
// rows an operator would ask about. (Before it runs, admit in settle.go
// settles a delivery that must not run with the same steps: drop, stop,
// expire, regenerate, fail.)

// outcome is how the handler ended.
type outcome int

const (
	outcomeOK          outcome = iota // it returned nil
	outcomeStopped                    // its client cancelled, or the gateway holding it is gone
	outcomeExpired                    // the request's deadline passed
	outcomeAbandoned                  // the gateway no longer holds the request (its cancel was lost)
	outcomeSuperseded                 // a later attempt of the request runs (this worker was cut off)
	outcomeInterrupted                // the grace period ran out at shutdown
	outcomeFailed                     // it failed: see facts.failure
)

// facts are what decide needs to know of a delivery.
type facts struct {
	stage dispatcher.Stage
	// handoff is set on a decode job carrying a prefill's KV.
	handoff bool
	// sent is set once chunks went to the client; ran once the engine
	// may have read the KV.
	sent, ran bool
	// attempt is this delivery's number, of maxDeliver.
	attempt, maxDeliver int
	// handBacks is set while the job may still be handed back.
	handBacks bool
	// handedOff is set on a prefill that produced its handoff; moved on
	// a decode that moved to another engine mid-answer.
	handedOff, moved bool
	// failure is the handler's error, for outcomeFailed.
	failure *Failure
}

// action is what a verdict does.
type action string

const (
	actAck        action = "ack"        // succeeded
	actMigrate    action = "migrate"    // went on on another engine
	actStop       action = "stop"       // ended by its client or gateway
	actExpire     action = "expire"     // ended by its deadline
	actNothing    action = "nothing"    // another delivery owns it
	actFail       action = "fail"       // ended by its failure
	actHandBack   action = "hand back"  // a copy for another worker
	actRegenerate action = "regenerate" // a new generation, from prefill
	actRetry      action = "retry"      // the same job, after a back-off
	actUnrun      action = "give back"  // not run: handed back, or naked
	actNak        action = "nak"        // back in the queue at once
)

// verdict is how one delivery settles.
type verdict struct {
	act action
	// release frees the KV first: the handoff this prefill produced (stop,
	// expire), or this decode's, which its engine did not read (fail,
	// regenerate).
	release bool
	// client is the error a failed request's client gets (fail); answer
	// is unset when the handler has already answered it.
	client *openai.Error
	answer bool
	// waste says why a regenerated handoff's prefill was wasted.
	waste waste
	// why is the cause, for the record, the log and the next generation;
	// note a warning logged first, with the handler's error.
	why, note string
}

// effect is what a verdict does to each party, for the table below.
type effect struct{ msg, record, client, kv, dlq string }

// effects says what every verdict does. "-" is nothing.
var effects = map[action]effect{
	actAck: {msg: "ack (a prefill's handoff stored first; a batch prompt's ack confirmed)",
		record: "- (the gateway records done; a replay's result is kept in it; a handoff not stored: failed)",
		client: "had its answer (a handoff not stored: 503, or 429 when the decode queue is full)", kv: "a prefill's: handed to the decode", dlq: "-"},
	actMigrate: {msg: "ack, once the continuation is stored", record: "next generation (failed when it cannot be stored)",
		client: "answer goes on (502 when it cannot)", kv: "-", dlq: "-"},
	actStop:    {msg: "term (dropped when not run)", record: "cancelled", client: "503 when its gateway is gone", kv: "released if unread", dlq: "-"},
	actExpire:  {msg: "term (dropped when not run)", record: "expired", client: "504", kv: "released if unread", dlq: "-"},
	actNothing: {msg: "-", record: "-", client: "-", kv: "-", dlq: "-"},
	actFail: {msg: "term (nak while the dead letter cannot be stored)", record: "failed", client: "the error",
		kv: "released if the engine refused before reading", dlq: "stored, unless the client's fault (4xx)"},
	actHandBack: {msg: "ack, once a copy is queued (nak with back-off while it cannot be)", record: "-", client: "-",
		kv: "unread, kept for the copy", dlq: "-"},
	actRegenerate: {msg: "term, once the next generation is queued", record: "next generation (failed when out of generations or not stored)",
		client: "- (the error when failed)", kv: "released if unread, else left to its lease", dlq: "as a failure, when failed"},
	actRetry: {msg: "nak with back-off", record: "-", client: "-", kv: "-", dlq: "-"},
	actUnrun: {msg: "ack once handed back as a copy, else nak", record: "-", client: "-", kv: "unread, kept", dlq: "-"},
	actNak:   {msg: "nak", record: "-", client: "-", kv: "-", dlq: "-"},
}

// decide is the verdict on a delivery with facts f whose handler ended
// with o. errText is the handler's error, for messages.
func decide(f facts, o outcome, errText string) verdict {
	decodeKV := f.stage == dispatcher.StageDecode && f.handoff
	switch o {
	case outcomeOK:
		if f.moved {
			return verdict{act: actMigrate}
		}
		return verdict{act: actAck}
	case outcomeStopped, outcomeAbandoned:
		// A prefill's answer that came after its client had gone: its
		// KV is released, not handed to a decode.
		return verdict{act: actStop, release: f.handedOff}
	case outcomeExpired:
		return verdict{act: actExpire, release: f.handedOff}
	case outcomeSuperseded:
		return verdict{act: actNothing}
	case outcomeInterrupted:
		switch {
		case f.sent:
			return verdict{act: actFail, answer: true, why: "interrupted by shutdown after output",
				client: openai.NewError(http.StatusBadGateway, "the %s worker shut down mid-answer", f.stage)}
		case decodeKV && !f.ran:
			return verdict{act: actUnrun, why: "interrupted by shutdown before its engine ran it"}
		case decodeKV:
			return verdict{act: actRegenerate, waste: wasteShutdown, why: "interrupted by shutdown; its KV may have been read"}
		}
		return verdict{act: actNak, why: "interrupted by shutdown"}
	}
	fl := f.failure
	if fl == nil {
		fl = &Failure{}
	}
	client := fl.Client
	if client == nil {
		client = openai.NewError(http.StatusBadGateway, "%s failed: %s", f.stage, errText)
	}
	if fl.Permanent {
		// A decode engine that refused the request never read its KV.
		return verdict{act: actFail, client: client, answer: !fl.Reported, release: fl.Rejected && f.stage == dispatcher.StageDecode}
	}
	switch {
	case fl.HandBack && !f.sent && f.handBacks:
		return verdict{act: actHandBack}
	case f.sent:
		// The client has part of the answer: no attempt can start over.
		return verdict{act: actFail, answer: true, client: openai.NewError(http.StatusBadGateway, "the %s stage failed mid-answer", f.stage)}
	case decodeKV && fl.Unread:
		return verdict{act: actRegenerate, release: true, waste: wasteDecodeFailed,
			why: "decode failed before its engine ran it: " + errText, note: "decode failed before its engine ran it"}
	case decodeKV:
		// Before output, but the engine may have read the KV blocks.
		return verdict{act: actRegenerate, waste: wasteDecodeFailed,
			why: "decode failed before output: " + errText, note: "decode failed before output"}
	case f.attempt < f.maxDeliver:
		return verdict{act: actRetry}
	}
	return verdict{act: actFail, answer: true, client: openai.NewError(client.Status(), "%s (after %d attempts)", client.Message, f.attempt)}
}

// outcomeOf is how a handler that returned err ended, given its job
// context's cause, whether it produced a handoff, and whether the loop is
// shutting down. A job that succeeded counts as such even when its client
// left meanwhile, unless it produced a handoff that nobody will decode.
func outcomeOf(err, cause error, handedOff, shutdown bool) outcome {
	stoppedBy := errors.Is(cause, errCancelled) || errors.Is(cause, errGatewayGone)
	expired := errors.Is(cause, errExpired)
	// A beat's answer stops a decode only if the handler ended by it: one
	// that came as the handler ended the reply itself (a beat racing its
	// end) leaves the handler's own outcome to settle.
	cutOff := errors.Is(err, context.Canceled)
	switch {
	case err == nil && handedOff && expired:
		return outcomeExpired
	case err == nil && handedOff && stoppedBy:
		return outcomeStopped
	case err == nil:
		return outcomeOK
	case stoppedBy:
		return outcomeStopped
	case expired:
		return outcomeExpired
	case cutOff && errors.Is(cause, reply.ErrAbandoned):
		return outcomeAbandoned
	case cutOff && errors.Is(cause, reply.ErrSuperseded):
		return outcomeSuperseded
	case shutdown:
		return outcomeInterrupted
	}
	return outcomeFailed
}
