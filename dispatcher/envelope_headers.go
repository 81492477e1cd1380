package dispatcher

// Headers of a job message.
const (
	HeaderVersion = "Pdq-Version"
	// HeaderReadsAs is the envelope version a job of a later version can
	// be read as, by a build that does not know its own: the later
	// version only adds what such a build may ignore. A build that writes
	// a version its predecessor cannot read says so here, and the two run
	// side by side during a rolling upgrade (docs/operations.md).
	HeaderReadsAs    = "Pdq-Reads-As"
	HeaderID         = "Pdq-Id"
	HeaderModel      = "Pdq-Model"
	HeaderPool       = "Pdq-Pool"
	HeaderEndpoint   = "Pdq-Endpoint"
	HeaderStream     = "Pdq-Stream"
	HeaderReplyTo    = "Pdq-Reply-To"
	HeaderDeadline   = "Pdq-Deadline"   // Unix milliseconds
	HeaderGeneration = "Pdq-Generation" // from 1
	// HeaderRebuilt marks a job the store doctor stored again (dispatcher/admin/doctor.go).
	HeaderRebuilt      = "Pdq-Rebuilt"
	HeaderOrigin       = "Pdq-Origin"    // the generation the request was claimed at
	HeaderSubmitted    = "Pdq-Submitted" // Unix microseconds
	HeaderPromptTokens = "Pdq-Prompt-Tokens"
	HeaderOwner        = "Pdq-Owner"
	HeaderClientID     = "Pdq-Client-Id"
	// HeaderParts lists the parts of a version 3 payload after the body,
	// in payload order, as name=length, comma-separated: "kv=123".
	HeaderParts = "Pdq-Parts"
	// HeaderKV carries a handoff's kv_transfer_params in version 2: those
	// that fit in a header (maxHeaderKV), which a decode worker of the
	// build before version 3 reads too. Longer ones go in the payload.
	HeaderKV = "Pdq-Kv-Transfer-Params"
	// HeaderPrefill is the prefill's StageRecord on a handoff, as JSON.
	HeaderPrefill = "Pdq-Prefill"
	// HeaderResume is a migrated decode's Resume, as JSON.
	HeaderResume = "Pdq-Resume"
	// HeaderHandBacks counts a job's hand-backs.
	HeaderHandBacks = "Pdq-Hand-Backs"
	// HeaderPrefer names the prefill engine that should take the job
	// first (Job.Prefer).
	HeaderPrefer = "Pdq-Prefer"
	// HeaderPreferDecode names the decode engine that should take the
	// job's decode first (Job.PreferDecode); a prefill job carries it to
	// its handoff.
	HeaderPreferDecode = "Pdq-Prefer-Decode"
	// HeaderReplyBatch is set on jobs whose gateway reads batched replies.
	HeaderReplyBatch = "Pdq-Reply-Batch"
	// HeaderReplyFrame is set on jobs whose gateway reads framed chunks.
	HeaderReplyFrame = "Pdq-Reply-Frame"
	// HeaderReplyStart is set on jobs whose gateway wants a beat as their
	// decode starts.
	HeaderReplyStart = "Pdq-Reply-Start"
	// HeaderReplyPrefilled is set on jobs whose gateway reads a prefilled
	// message (KindPrefilled); a gateway of an earlier build fails a
	// reply of a kind it does not know, and does not set it.
	HeaderReplyPrefilled = "Pdq-Reply-Prefilled"
	// HeaderBatchPrompt is set on the jobs of a batched request's prompts.
	HeaderBatchPrompt = "Pdq-Batch-Prompt"
	// HeaderRecordRevision is the job's RecordRevision, when known.
	HeaderRecordRevision = "Pdq-Record-Revision"
)

// Headers of reply and dead-letter messages.
const (
	// HeaderKind is the kind of a reply message: chunk, beat, moved, done,
	// error, or the gateway's ack.
	HeaderKind = "Pdq-Kind"
	// HeaderSeq numbers the chunks of one reply from 0; on beat, moved, done
	// and error it is the number of chunks sent, and on an ack the number
	// of chunks the gateway has, in order.
	HeaderSeq = "Pdq-Seq"
	// HeaderCount is the number of chunks a chunk message carries, from
	// HeaderSeq on, separated by newlines (a chunk that holds one is sent
	// on its own); 1 when absent. Only jobs with ReplyBatch get such
	// messages.
	HeaderCount = "Pdq-Count"
	// HeaderAttempt orders the attempts that write a request's reply: see
	// [ReplyAttempt]. A reply from a later attempt starts over.
	HeaderAttempt = "Pdq-Attempt"
	// HeaderDelivery names one delivery of a job, in a running query: the
	// delivery count cannot, since a restarted nats-server may deliver a
	// job again as a first delivery.
	HeaderDelivery = "Pdq-Delivery"
	// HeaderStatus is the HTTP status of an error reply.
	HeaderStatus = "Pdq-Status"
	// HeaderStages carries the stage records on a done reply, as JSON, for
	// the gateway's request record.
	HeaderStages = "Pdq-Stages"
	// HeaderGone on the gateway's ack of a beat says the gateway no longer
	// holds the request (answered, given up, or followed by a later
	// attempt): the worker stops. A cancel broadcast may be lost; this
	// answer comes within a beat.
	HeaderGone = "Pdq-Gone"
	// HeaderStage and HeaderReason label a dead letter.
	HeaderStage  = "Pdq-Stage"
	HeaderReason = "Pdq-Reason"
)

// Reply kinds.
const (
	KindChunk = "chunk"
	KindDone  = "done"
	KindError = "error"
	// KindBeat is a running decode's heartbeat: the gateway acks it with
	// the chunks it has, and the worker resends the ones it lacks.
	KindBeat = "beat"
	// KindMoved ends a decode whose reply a later generation continues
	// from this chunk on (a migration).
	KindMoved = "moved"
	// KindAck is the gateway's answer to a beat, moved, done or error.
	KindAck = "ack"
	// KindPrefilled says a prefill of the request ended and its engine
	// is free for the next one, for a gateway whose fair queue asked
	// (Job.ReplyPrefilled): sent once, not acked, carrying the engine's
	// key (EngineKey; empty from a worker of an earlier build).
	KindPrefilled = "prefilled"
)

// ReplyAttempt orders the writers of one request's reply: later
// generations after earlier ones, and within a generation later deliveries
// after earlier ones. Prefill errors are delivery 0 of their generation.
func ReplyAttempt(generation, delivery int) int {
	return generation<<8 | min(delivery, 255)
}
