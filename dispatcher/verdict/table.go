package verdict

import (
	"net/http"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Outcome is how the handler ended.
type Outcome int

const (
	OK          Outcome = iota // it returned nil
	Stopped                    // its client cancelled, or the gateway holding it is gone
	Expired                    // the request's deadline passed
	Abandoned                  // the gateway no longer holds the request (its cancel was lost)
	Superseded                 // a later attempt of the request runs (this worker was cut off)
	Interrupted                // the grace period ran out at shutdown
	Failed                     // it failed: see Facts.Failure
)

// Facts are what Decide needs to know of a delivery.
type Facts struct {
	Stage dispatcher.Stage
	// Handoff is set on a decode job carrying a prefill's KV.
	Handoff bool
	// Sent is set once chunks went to the client; Ran once the engine
	// may have read the KV.
	Sent, Ran bool
	// Attempt is this delivery's number, of MaxDeliver.
	Attempt, MaxDeliver int
	// HandBacks is set while the job may still be handed back.
	HandBacks bool
	// HandedOff is set on a prefill that produced its handoff; Moved on
	// a decode that moved to another engine mid-answer.
	HandedOff, Moved bool
	// Failure is the handler's error, for Failed.
	Failure *Failure
}

// Action is what a verdict does.
type Action string

const (
	ActAck        Action = "ack"        // succeeded
	ActMigrate    Action = "migrate"    // went on on another engine
	ActStop       Action = "stop"       // ended by its client or gateway
	ActExpire     Action = "expire"     // ended by its deadline
	ActNothing    Action = "nothing"    // another delivery owns it
	ActFail       Action = "fail"       // ended by its failure
	ActHandBack   Action = "hand back"  // a copy for another worker
	ActRegenerate Action = "regenerate" // a new generation, from prefill
	ActRetry      Action = "retry"      // the same job, after a back-off
	ActUnrun      Action = "give back"  // not run: handed back, or naked
	ActNak        Action = "nak"        // back in the queue at once
)

// Verdict is how one delivery settles.
type Verdict struct {
	Act Action
	// Release frees the KV first: the handoff this prefill produced (stop,
	// expire), or this decode's, which its engine did not read (fail,
	// regenerate).
	Release bool
	// Client is the error a failed request's client gets (fail); Answer
	// is unset when the handler has already answered it.
	Client *openai.Error
	Answer bool
	// Waste says why a regenerated handoff's prefill was wasted.
	Waste Waste
	// Why is the cause, for the record, the log and the next generation;
	// Note a warning logged first, with the handler's error.
	Why, Note string
}

// Waste is why a prefill's KV went unread: pdq_prefills_wasted_total's
// reason.
type Waste string

const (
	WasteKVTTL        Waste = "kv_ttl"        // the handoff waited past PDQ_KV_TTL
	WasteRedelivered  Waste = "redelivered"   // an earlier delivery may have read its KV
	WasteDecodeFailed Waste = "decode_failed" // its decode failed before output
	WasteShutdown     Waste = "shutdown"      // its decode was interrupted by shutdown
)

// WasteReasons are every Waste, for the metric's series from the start.
func WasteReasons() []Waste {
	return []Waste{WasteKVTTL, WasteRedelivered, WasteDecodeFailed, WasteShutdown}
}

// Effect is what a verdict does to each party: the job's message, the
// request's record, the client's answer, the handoff's KV and the dead
// letter.
type Effect struct{ Msg, Record, Client, KV, DLQ string }

// Effects says what a verdict's action does; ok is false for an action
// the table does not know.
func Effects(a Action) (e Effect, ok bool) {
	e, ok = effects[a]
	return e, ok
}

// effects says what every verdict does, in one place. "-" is nothing.
var effects = map[Action]Effect{
	ActAck: {Msg: "ack (a prefill's handoff stored first; a batch prompt's ack confirmed)",
		Record: "- (the gateway records done; a replay's result is kept in it; a handoff not stored: failed)",
		Client: "had its answer (a handoff not stored: 503, or 429 when the decode queue is full)", KV: "a prefill's: handed to the decode", DLQ: "-"},
	ActMigrate: {Msg: "ack, once the continuation is stored", Record: "next generation (failed when it cannot be stored)",
		Client: "answer goes on (502 when it cannot)", KV: "-", DLQ: "-"},
	ActStop:    {Msg: "term (dropped when not run)", Record: "cancelled", Client: "503 when its gateway is gone", KV: "released if unread", DLQ: "-"},
	ActExpire:  {Msg: "term (dropped when not run)", Record: "expired", Client: "504", KV: "released if unread", DLQ: "-"},
	ActNothing: {Msg: "-", Record: "-", Client: "-", KV: "-", DLQ: "-"},
	ActFail: {Msg: "term (nak while the dead letter cannot be stored)", Record: "failed", Client: "the error",
		KV: "released if the engine refused before reading", DLQ: "stored, unless the client's fault (4xx)"},
	ActHandBack: {Msg: "ack, once a copy is queued (nak with back-off while it cannot be)", Record: "-", Client: "-",
		KV: "unread, kept for the copy", DLQ: "-"},
	ActRegenerate: {Msg: "term, once the next generation is queued", Record: "next generation (failed when out of generations or not stored)",
		Client: "- (the error when failed)", KV: "released if unread, else left to its lease", DLQ: "as a failure, when failed"},
	ActRetry: {Msg: "nak with back-off", Record: "-", Client: "-", KV: "-", DLQ: "-"},
	ActUnrun: {Msg: "ack once handed back as a copy, else nak", Record: "-", Client: "-", KV: "unread, kept", DLQ: "-"},
	ActNak:   {Msg: "nak", Record: "-", Client: "-", KV: "-", DLQ: "-"},
}

// Decide is the verdict on a delivery with facts f whose handler ended
// with o. errText is the handler's error, for messages.
func Decide(f Facts, o Outcome, errText string) Verdict {
	decodeKV := f.Stage == dispatcher.StageDecode && f.Handoff
	switch o {
	case OK:
		if f.Moved {
			return Verdict{Act: ActMigrate}
		}
		return Verdict{Act: ActAck}
	case Stopped, Abandoned:
		// A prefill's answer that came after its client had gone: its
		// KV is released, not handed to a decode.
		return Verdict{Act: ActStop, Release: f.HandedOff}
	case Expired:
		return Verdict{Act: ActExpire, Release: f.HandedOff}
	case Superseded:
		// Another delivery runs the job: a prefill's answer that came
		// meanwhile has no reader, and its KV is released.
		return Verdict{Act: ActNothing, Release: f.HandedOff}
	case Interrupted:
		switch {
		case f.Sent:
			return Verdict{Act: ActFail, Answer: true, Why: "interrupted by shutdown after output",
				Client: openai.NewError(http.StatusBadGateway, "the %s worker shut down mid-answer", f.Stage)}
		case decodeKV && !f.Ran:
			return Verdict{Act: ActUnrun, Why: "interrupted by shutdown before its engine ran it"}
		case decodeKV:
			return Verdict{Act: ActRegenerate, Waste: WasteShutdown, Why: "interrupted by shutdown; its KV may have been read"}
		}
		return Verdict{Act: ActNak, Why: "interrupted by shutdown"}
	}
	fl := f.Failure
	if fl == nil {
		fl = &Failure{}
	}
	client := fl.Client
	if client == nil {
		client = openai.NewError(http.StatusBadGateway, "%s failed: %s", f.Stage, errText)
	}
	if fl.Permanent {
		// A decode engine that refused the request never read its KV.
		return Verdict{Act: ActFail, Client: client, Answer: !fl.Reported, Release: fl.Rejected && f.Stage == dispatcher.StageDecode}
	}
	switch {
	case fl.HandBack && !f.Sent && f.HandBacks:
		return Verdict{Act: ActHandBack}
	case f.Sent:
		// The client has part of the answer: no attempt can start over.
		return Verdict{Act: ActFail, Answer: true, Client: openai.NewError(http.StatusBadGateway, "the %s stage failed mid-answer", f.Stage)}
	case decodeKV && fl.Unread:
		return Verdict{Act: ActRegenerate, Release: true, Waste: WasteDecodeFailed,
			Why: "decode failed before its engine ran it: " + errText, Note: "decode failed before its engine ran it"}
	case decodeKV:
		// Before output, but the engine may have read the KV blocks.
		return Verdict{Act: ActRegenerate, Waste: WasteDecodeFailed,
			Why: "decode failed before output: " + errText, Note: "decode failed before output"}
	case f.Attempt < f.MaxDeliver:
		return Verdict{Act: ActRetry}
	}
	return Verdict{Act: ActFail, Answer: true, Client: openai.NewError(client.Status(), "%s (after %d attempts)", client.Message, f.Attempt)}
}
