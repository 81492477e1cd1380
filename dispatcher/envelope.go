package dispatcher

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// EnvelopeVersion is the version of the job envelope this build writes
// for a job whose payload is the client's body alone: the body's bytes,
// never re-encoded, with everything else in headers (a handoff's
// kv_transfer_params too, while they fit maxHeaderKV). A job whose payload
// carries more than the body (longer params, a continuation's text) is
// written as [EnvelopeParts]. This build reads both.
const EnvelopeVersion = 2

// EnvelopeParts is the version of a job whose payload is the client's body
// followed by the parts HeaderParts lists. Headers hold bounded metadata
// only: NATS refuses headers over 64 KiB, and a handoff's
// kv_transfer_params grow with the prompt (its remote_block_ids, about
// 8,000 ids at 128k tokens). A worker of an older build refuses such a job
// (answered and dead-lettered) rather than read the parts as body and
// decode without the KV, which would silently recompute the prompt.
const EnvelopeParts = 3

// Job is a request on its way through the stages. On the wire it is the
// client's body as the message payload and the rest as headers (see
// [Job.Msg]); the queue never re-encodes the body or the engine's
// kv_transfer_params. Only the workers edit the P/D fields of the body for
// their engine.
type Job struct {
	// ID is the request id: the subject token and the X-Request-Id of both
	// engine calls.
	ID       string
	Model    string
	Pool     string
	Endpoint openai.Endpoint
	// Stream is the client's stream flag; the decode call keeps it.
	Stream bool
	// ReplyTo is the gateway's reply subject; empty for a replay, whose
	// result goes to the request record instead.
	ReplyTo string
	// Deadline is when the request stops being worth any work.
	Deadline time.Time
	// Generation counts the starts of this request's prefill, from 1. A
	// decode that fails before output, a handoff too old for its KV, a
	// client's retry under the same id, and a replay each start the next
	// one, with new message ids, so consumed KV is never read again.
	Generation int
	// Rebuilt is set on a job read from a message the store doctor stored
	// again (HeaderRebuilt): it may have run before, under delivery
	// numbers this copy's cannot know. Not written back by Msg: a copy
	// of it is a new message.
	Rebuilt bool
	// Origin is the generation its request was claimed at: the new
	// generations of one request (a prefill again, a migration) keep it,
	// while a client's retry of the id, or a replay, claims a new one. A
	// cancel names the request it stops by it, so that a late one cannot
	// stop a retry's work. 0 on a job of an older gateway.
	Origin    int
	Submitted time.Time
	// PromptTokens is the gateway's estimate, which chose P/D or
	// decode-only.
	PromptTokens int
	// Owner names the API key that made the request (a hash of it, not
	// the key), for its record; empty on a gateway that takes no keys.
	Owner string
	// ClientID is the client's X-Request-Id when it is not ID itself (see
	// RequestKey), for its record and its workers' logs.
	ClientID string
	// Body is the client's request body, without any kv_transfer_params,
	// on every job of the request: a migrated decode builds its
	// continuation from it and Sent (see Resume), and a replay starts from
	// it.
	Body json.RawMessage
	// Sent is set on a migrated decode: the text its client has been
	// sent, which the continuation goes on from. It travels in the
	// payload: it grows with the answer.
	Sent []byte

	// KV is set on a handoff: the prefill engine's kv_transfer_params for
	// the decode engine, unchanged but for remote_host.
	KV json.RawMessage
	// Prefill says where and when the prefill ran, on a handoff.
	Prefill *StageRecord
	// Resume is set on a migrated decode: a decode that failed after
	// output, continued by another engine from the text it had generated.
	Resume *Resume
	// ReplyBatch says the gateway reads reply messages that carry several
	// chunks (HeaderCount); a worker sends one chunk per message otherwise.
	ReplyBatch bool
	// BatchPrompt marks a prompt of a batched completions request: its record
	// ends with the whole batch's, so its success is acked with
	// JetStream's confirmation (see settle.succeeded).
	BatchPrompt bool
	// ReplyFramed says the gateway reads chunk messages framed in their
	// payload, without NATS headers (see reply.Writer); a worker sends
	// them with headers otherwise.
	ReplyFramed bool
	// ReplyStart says the gateway wants to hear at once that a decode of
	// the job started: a beat as it starts (see reply.Writer.BeatAtOnce),
	// not after the first interval. Its fair queue's turn ends then, or
	// at the prefill's end (ReplyPrefilled), whichever comes first.
	ReplyStart bool
	// ReplyPrefilled says the gateway reads the prefill worker's
	// prefilled message (reply.Writer.Prefilled): only then is it sent.
	ReplyPrefilled bool
	// HandBacks counts the times a worker gave the job back unrun (its
	// engine failing, or a continuation's engine the one it broke on);
	// each copy has its own message id.
	HandBacks int
	// Prefer is the key (affinity.Key) of the prefill engine whose prefix
	// cache likely holds the prompt's start: its worker is offered the
	// job first, on a subject of its own (see PreferredSubject), and any
	// other worker of the pool takes it when that one has no room or is
	// gone. Empty: any worker. Only a prefill job is published so; a copy
	// published again (a retry, a hand-back) goes to any worker.
	Prefer string
	// PreferDecode is the key of the decode engine whose prefix cache
	// likely holds the prompt's start (a conversation's earlier turns,
	// which it decoded): the decode job, a handoff or decode-only, is
	// published for it first, as Prefer for a prefill. A prefill job
	// carries it to its handoff. A new generation goes to any worker, and
	// so does a decode handed back.
	PreferDecode string
	// RecordRevision is the revision its request's record had when this
	// generation was queued, when that is known (0 otherwise). While the
	// record is still at it, nothing has ended, retried or moved the
	// request on, and admit skips decoding the record.
	RecordRevision uint64
}

// Resume is what a migrated decode needs to continue the reply its earlier
// generations began as if it were one stream.
type Resume struct {
	// Chunks is how many reply chunks the client has: the continuation's
	// first chunk is numbered so.
	Chunks int `json:"chunks"`
	// Tokens is how many tokens they held: the continuation counts them in
	// its usage.
	Tokens int `json:"tokens"`
	// Created is the response's created time, which every chunk repeats.
	Created int64 `json:"created"`
	// Migrations counts the moves so far, for PDQ_MIGRATION_LIMIT.
	Migrations int `json:"migrations"`
	// Original says the job's Body is the client's, and the text sent is
	// in Job.Sent; a continuation an older pdq stored has the continued
	// body as its Body instead.
	Original bool `json:"original,omitempty"`
	// Avoid is the engine the decode broke on (its URL), and AvoidUntil
	// (Unix milliseconds) how long a worker in front of it hands the
	// continuation on to another whose engine is healthy, rather than
	// break it again past the limit. Only the latest break is named.
	Avoid      string `json:"avoid,omitempty"`
	AvoidUntil int64  `json:"avoid_until,omitempty"`
}

// StageRecord says where and when a stage ran.
type StageRecord struct {
	Stage      Stage     `json:"stage"`
	Generation int       `json:"generation"`
	Worker     string    `json:"worker"`
	Engine     string    `json:"engine"`
	Started    time.Time `json:"started"`
	// Ms is the engine call's duration in milliseconds.
	Ms float64 `json:"ms"`
}

// Ended is when the stage's engine call returned.
func (s *StageRecord) Ended() time.Time {
	return s.Started.Add(time.Duration(s.Ms * float64(time.Millisecond)))
}

// Preferred is the key of the engine that should take the job of stage
// first (Prefer or PreferDecode); empty for any worker.
func (j *Job) Preferred(stage Stage) string {
	if stage == StagePrefill {
		return j.Prefer
	}
	return j.PreferDecode
}

// Expired reports whether the job's deadline has passed at now.
func (j *Job) Expired(now time.Time) bool { return !j.Deadline.IsZero() && now.After(j.Deadline) }

// GatewayID is the id of the gateway that holds the client, from the reply
// subject; empty for a replay.
func (j *Job) GatewayID() string {
	rest, ok := strings.CutPrefix(j.ReplyTo, subjectReply+".")
	if !ok {
		return ""
	}
	gw, _, ok := strings.Cut(rest, ".")
	if !ok {
		return ""
	}
	return gw
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
	case j.Generation < 1:
		return fmt.Errorf("job %s has generation %d", j.ID, j.Generation)
	}
	return nil
}

// MsgID is the Nats-Msg-Id of the job's message on stage: one per stage and
// generation, so a republish after a crash is deduplicated and a new
// generation is not.
func (j *Job) MsgID(stage Stage) string {
	id := j.ID + "/" + string(stage[0]) + strconv.Itoa(j.Generation)
	if j.HandBacks > 0 {
		id += "." + strconv.Itoa(j.HandBacks)
	}
	return id
}

// Msg is the job as a message for stage's subject.
func (j *Job) Msg(stage Stage) *nats.Msg {
	subject := JobSubject(stage, j.Pool, j.ID)
	if engine := j.Preferred(stage); engine != "" {
		subject = PreferredSubject(stage, j.Pool, j.ID, engine)
	}
	m := nats.NewMsg(subject)
	h := m.Header
	h[HeaderVersion] = writeBody
	if writeBody[0] != versionBody[0] {
		h[HeaderReadsAs] = versionBody
	}
	h[HeaderID] = []string{j.ID}
	h[HeaderModel] = []string{j.Model}
	h[HeaderPool] = []string{j.Pool}
	h[HeaderEndpoint] = []string{string(j.Endpoint)}
	h[HeaderStream] = []string{strconv.FormatBool(j.Stream)}
	if j.ReplyTo != "" {
		h[HeaderReplyTo] = []string{j.ReplyTo}
	}
	if !j.Deadline.IsZero() {
		h[HeaderDeadline] = []string{strconv.FormatInt(j.Deadline.UnixMilli(), 10)}
	}
	h[HeaderGeneration] = []string{strconv.Itoa(j.Generation)}
	if j.Origin > 0 {
		h[HeaderOrigin] = []string{strconv.Itoa(j.Origin)}
	}
	h[HeaderSubmitted] = []string{strconv.FormatInt(j.Submitted.UnixMicro(), 10)}
	h[HeaderPromptTokens] = []string{strconv.Itoa(j.PromptTokens)}
	if j.Owner != "" {
		h[HeaderOwner] = []string{j.Owner}
	}
	if j.ClientID != "" {
		h[HeaderClientID] = []string{j.ClientID}
	}
	if j.Prefill != nil {
		rec, _ := json.Marshal(j.Prefill) // plain fields: it always encodes
		h[HeaderPrefill] = []string{string(rec)}
	}
	if j.Resume != nil {
		res, _ := json.Marshal(j.Resume) // plain fields: it always encodes
		h[HeaderResume] = []string{string(res)}
	}
	if j.HandBacks > 0 {
		h[HeaderHandBacks] = []string{strconv.Itoa(j.HandBacks)}
	}
	if j.Prefer != "" && stage == StagePrefill {
		h[HeaderPrefer] = []string{j.Prefer}
	}
	if j.PreferDecode != "" {
		h[HeaderPreferDecode] = []string{j.PreferDecode}
	}
	if j.ReplyBatch {
		h[HeaderReplyBatch] = []string{"1"}
	}
	if j.ReplyFramed {
		h[HeaderReplyFrame] = []string{"1"}
	}
	if j.ReplyStart {
		h[HeaderReplyStart] = []string{"1"}
	}
	if j.ReplyPrefilled {
		h[HeaderReplyPrefilled] = []string{"1"}
	}
	if j.BatchPrompt {
		h[HeaderBatchPrompt] = []string{"1"}
	}
	if j.RecordRevision > 0 {
		h[HeaderRecordRevision] = []string{strconv.FormatUint(j.RecordRevision, 10)}
	}
	h[nats.MsgIdHdr] = []string{j.MsgID(stage)}
	m.Data = j.Body
	if len(j.KV) > 0 && len(j.KV) <= maxHeaderKV && len(j.Sent) == 0 {
		// Params that fit a header go in one, as version 2: a decode
		// worker of the build before version 3 reads them, so an upgrade
		// need not stop the fleet.
		h[HeaderKV] = []string{string(j.KV)}
		return m
	}
	if len(j.KV) > 0 || len(j.Sent) > 0 {
		// What grows with the request follows the body in the payload:
		// a handoff's params grow with the prompt, a continuation's text
		// with the answer. The body is copied once, before them.
		h[HeaderVersion] = writeParts
		if writeParts[0] != versionParts[0] {
			h[HeaderReadsAs] = versionParts
		} else {
			delete(h, HeaderReadsAs)
		}
		parts := ""
		data := make([]byte, 0, len(j.Body)+len(j.KV)+len(j.Sent))
		data = append(data, j.Body...)
		if len(j.KV) > 0 {
			parts = partKV + "=" + strconv.Itoa(len(j.KV))
			data = append(data, j.KV...)
		}
		if len(j.Sent) > 0 {
			if parts != "" {
				parts += ","
			}
			parts += partSent + "=" + strconv.Itoa(len(j.Sent))
			data = append(data, j.Sent...)
		}
		h[HeaderParts] = []string{parts}
		m.Data = data
	}
	return m
}

// maxHeaderKV is the largest kv_transfer_params still written in a header
// (version 2): some 2,500 block ids, a prompt of some 40,000 tokens. NATS
// takes 64 KiB of headers in all.
const maxHeaderKV = 16 << 10

// The version header's values, made once.
var (
	versionBody  = []string{strconv.Itoa(EnvelopeVersion)}
	versionParts = []string{strconv.Itoa(EnvelopeParts)}
	// writeBody and writeParts are the versions this build writes: its
	// own, or with the pdqnext build tag a version higher, read as these
	// (see envelope_next.go).
	writeBody, writeParts = versionBody, versionParts
)

// The parts a version 3 payload may carry after the body: a handoff's
// kv_transfer_params, a continuation's text sent.
const (
	partKV   = "kv"
	partSent = "sent"
)

// splitParts cuts a version 3 payload into the body and the parts its
// HeaderParts value lists. Every part must be one this build knows: a
// part left unread could be one the job cannot run without.
func splitParts(list string, data []byte) (body, kv, sent []byte, err error) {
	if list == "" {
		return nil, nil, nil, fmt.Errorf("header %s: missing from a version %d job", HeaderParts, EnvelopeParts)
	}
	end := len(data)
	names := strings.Split(list, ",")
	// The parts are the payload's tail, in order: cut them from the end.
	for i := len(names) - 1; i >= 0; i-- {
		name, size, ok := strings.Cut(names[i], "=")
		n, nerr := strconv.Atoi(size)
		if !ok || nerr != nil || n < 0 || n > end {
			return nil, nil, nil, fmt.Errorf("header %s: bad part %q for a payload of %d bytes", HeaderParts, names[i], len(data))
		}
		part := data[end-n : end : end]
		switch {
		case name == partKV && kv == nil:
			kv = part
		case name == partSent && sent == nil:
			sent = part
		default:
			return nil, nil, nil, fmt.Errorf("header %s: unknown or repeated part %q", HeaderParts, name)
		}
		end -= n
	}
	return data[:end:end], kv, sent, nil
}

// ErrEnvelopeVersion means a message was written by a pdq this build does
// not understand.
var ErrEnvelopeVersion = errors.New("unknown envelope version")

// ParseJob reads a job message. It returns what it could read even when it
// fails, so that a job that cannot run can still be answered at its reply
// subject.
func ParseJob(h nats.Header, data []byte) (*Job, error) {
	j := &Job{
		ID: h.Get(HeaderID), Model: h.Get(HeaderModel), Pool: h.Get(HeaderPool),
		Endpoint: openai.Endpoint(h.Get(HeaderEndpoint)), ReplyTo: h.Get(HeaderReplyTo), Owner: h.Get(HeaderOwner),
		ClientID: h.Get(HeaderClientID), Body: data, Prefer: h.Get(HeaderPrefer), PreferDecode: h.Get(HeaderPreferDecode),
		Rebuilt: h.Get(HeaderRebuilt) != "",
	}
	v := h.Get(HeaderVersion)
	as := v
	if v != versionBody[0] && v != versionParts[0] && h.Get(HeaderReadsAs) != "" {
		as = h.Get(HeaderReadsAs) // a later build's job, readable as one of these
	}
	switch as {
	case versionBody[0]:
		// A handoff whose params fit a header has them there (and one
		// written by a prefill worker of the build before, whatever their
		// length).
		if kv := h.Get(HeaderKV); kv != "" {
			j.KV = json.RawMessage(kv)
		}
	case versionParts[0]:
		body, kv, sent, err := splitParts(h.Get(HeaderParts), data)
		if err != nil {
			j.Body = nil
			return j, err
		}
		j.Body, j.KV, j.Sent = body, kv, sent
	default:
		// Its generation still: the refusal is answered, and recorded, as
		// the generation the gateway waits for (a reply of generation 0
		// would be taken for an earlier one's, and dropped).
		j.Generation, _ = strconv.Atoi(h.Get(HeaderGeneration))
		j.Origin, _ = strconv.Atoi(h.Get(HeaderOrigin))
		return j, fmt.Errorf("%w %q (this pdq reads %d and %d)", ErrEnvelopeVersion, v, EnvelopeVersion, EnvelopeParts)
	}
	var errs []error
	num := func(key string) int64 {
		v := h.Get(key)
		if v == "" {
			return 0
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			errs = append(errs, fmt.Errorf("header %s: %w", key, err))
		}
		return n
	}
	j.Stream = h.Get(HeaderStream) == "true"
	if ms := num(HeaderDeadline); ms != 0 {
		j.Deadline = time.UnixMilli(ms)
	}
	j.Generation = int(num(HeaderGeneration))
	j.Origin = int(num(HeaderOrigin))
	j.Submitted = time.UnixMicro(num(HeaderSubmitted))
	j.PromptTokens = int(num(HeaderPromptTokens))
	j.HandBacks = int(num(HeaderHandBacks))
	// Only a hint for admit: one that does not read is left out.
	j.RecordRevision, _ = strconv.ParseUint(h.Get(HeaderRecordRevision), 10, 64)
	j.ReplyBatch = h.Get(HeaderReplyBatch) == "1"
	j.ReplyFramed = h.Get(HeaderReplyFrame) == "1"
	j.ReplyStart = h.Get(HeaderReplyStart) == "1"
	j.ReplyPrefilled = h.Get(HeaderReplyPrefilled) == "1"
	j.BatchPrompt = h.Get(HeaderBatchPrompt) == "1"
	if p := h.Get(HeaderPrefill); p != "" {
		j.Prefill = new(StageRecord)
		if err := json.Unmarshal([]byte(p), j.Prefill); err != nil {
			errs = append(errs, fmt.Errorf("header %s: %w", HeaderPrefill, err))
		}
	}
	if r := h.Get(HeaderResume); r != "" {
		j.Resume = new(Resume)
		if err := json.Unmarshal([]byte(r), j.Resume); err != nil {
			errs = append(errs, fmt.Errorf("header %s: %w", HeaderResume, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return j, err
	}
	return j, j.Validate()
}

// CompactKV returns params as compact JSON: the same object, without the
// whitespace, which a header value cannot hold (a newline) and a handoff
// need not store.
func CompactKV(params json.RawMessage) (json.RawMessage, error) {
	var b bytes.Buffer
	if err := json.Compact(&b, params); err != nil {
		return nil, fmt.Errorf("kv_transfer_params: %w", err)
	}
	return b.Bytes(), nil
}
