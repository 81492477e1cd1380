package dispatcher

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
)

// Stage is one of the two legs a request runs through.
type Stage string

// The stages.
const (
	StagePrefill Stage = "prefill"
	StageDecode  Stage = "decode"
)

// Stream and bucket names.
const (
	StreamPrefill  = "PDQ_PREFILL"
	StreamDecode   = "PDQ_DECODE"
	StreamDLQ      = "PDQ_DLQ"
	StreamRelease  = "PDQ_RELEASE"
	BucketWorkers  = "pdq_workers"
	BucketRequests = "pdq_requests"
	BucketKVReads  = "pdq_kv_reads"
)

// Subject prefixes. A job's subject is <prefix>.<pool>.<request id>.
const (
	SubjectPrefill = "pdq.prefill"
	SubjectDecode  = "pdq.decode"
	SubjectDLQ     = "pdq.dlq"
	SubjectRelease = "pdq.release"
	// subjectReleaseNow is core NATS, outside the release stream's
	// pdq.release.>: a release asked of a decode worker directly.
	subjectReleaseNow = "pdq.releasenow"
	subjectReply      = "pdq.reply"
	subjectRunning    = "pdq.running"
	subjectCancel     = "pdq.cancel"
	subjectGateway    = "pdq.gateway"
)

// JobSubject is where a job for stage, pool and request id is published
// for any worker of the pool.
func JobSubject(stage Stage, pool, id string) string {
	return StageSubject(stage) + "." + pool + "." + id
}

// PreferredSubject is where a job that prefers the engine keyed engine
// (see Job.Preferred) is published: one token more than JobSubject, so that
// the pool's shared consumer (<pool>.*) and the engine's own
// (<pool>.*.<engine>) never both take it.
func PreferredSubject(stage Stage, pool, id, engine string) string {
	return JobSubject(stage, pool, id) + "." + engine
}

// JobSubjects matches every subject a job of stage, pool and request id
// may have: for any worker, or preferring an engine.
func JobSubjects(stage Stage, pool, id string) []string {
	s := JobSubject(stage, pool, id)
	return []string{s, s + ".*"}
}

// EngineKey is the token that names the engine at url in job subjects
// and consumer names: short, and the same in every process that knows the
// url (the gateway from the registry, the worker from its config).
func EngineKey(url string) string {
	sum := sha256.Sum256([]byte(url))
	return "e" + hex.EncodeToString(sum[:5])
}

// EngineConsumerName is the durable consumer of the jobs that prefer the
// engine keyed engine, in stage and pool.
func EngineConsumerName(stage Stage, pool, engine string) string {
	return ConsumerName(stage, pool) + "-" + engine
}

func StageSubject(stage Stage) string {
	if stage == StagePrefill {
		return SubjectPrefill
	}
	return SubjectDecode
}

func StageStream(stage Stage) string {
	if stage == StagePrefill {
		return StreamPrefill
	}
	return StreamDecode
}

// ConsumerName is the durable consumer shared by all workers of a stage and
// pool.
func ConsumerName(stage Stage, pool string) string { return string(stage) + "-" + pool }

// ReplySubject is where the workers of a request send its reply chunks: the
// gateway that holds the client subscribes to pdq.reply.<gateway>.>.
func ReplySubject(gatewayID, id string) string { return subjectReply + "." + gatewayID + "." + id }

// CancelSubject carries the cancel broadcast of a request whose client went
// away.
func CancelSubject(id string) string { return subjectCancel + "." + id }

// RunningSubject is where the stage loops say whether they run a delivery
// of request id: asked about a job redelivered while its first delivery
// may still run (a worker cut off from NATS for longer than the ack wait).
func RunningSubject(id string) string { return subjectRunning + "." + id }

// GatewaySubject is where a gateway answers the pings of workers that ask
// whether it still holds its clients.
func GatewaySubject(gatewayID string) string { return subjectGateway + "." + gatewayID }

// ReleaseSubject is where a handoff that could not be stored waits for a
// decode worker of its pool to release its KV.
func ReleaseSubject(pool, id string) string { return SubjectRelease + "." + pool + "." + id }

// ReleaseNowSubject is where the decode workers of a pool, one of them
// for each message (a queue group), release a handoff's KV when the
// release queue cannot store it (a full store).
func ReleaseNowSubject(pool string) string { return subjectReleaseNow + "." + pool }

// DLQSubject is where a request that failed for good is kept for replay.
func DLQSubject(pool, id string) string { return SubjectDLQ + "." + pool + "." + id }

// validID is the request id rule, [A-Za-z0-9_-]{1,128}: the id becomes a
// subject token, so '.', '*', '>' and whitespace must never get through.
// It is checked several times per request: a loop, since a regexp showed
// in profiles (docs/benchmarks.md, what changed).
func validID(id string) bool {
	if len(id) < 1 || len(id) > 128 {
		return false
	}
	for i := range len(id) {
		switch c := id[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// ValidRequestID reports whether id may be used as a request id: a key
// that [RequestKey] returns, the key of a batch's prompt, or an id pdq
// made.
func ValidRequestID(id string) bool { return validID(id) }

// MaxClientIDLen bounds a client's X-Request-Id. vLLM takes any header
// value; pdq keeps the id in its request record and echoes it, so a bound
// keeps those small. 256 bytes hold a UUID, a W3C traceparent (55), an
// AWS trace id (~80) and the prefix-plus-index ids of load generators
// (vLLM's bench: bench-<8 hex>-<n>) with room to spare.
const MaxClientIDLen = 256

// maxKeptIDLen is the longest subject-safe id kept as its own key: a
// batched prompt runs as <key>-<i> (i < 256), which must stay within the
// 128 bytes of a request id.
const maxKeptIDLen = 124

// hashedKeyPrefix starts every key made from a hash. A client id that
// starts with it is hashed too, so that no id kept as it is can be another
// id's hashed key.
const hashedKeyPrefix = "pdqid_"

// ErrInvalidRequestID is the error of [RequestKey] for an id it does not
// take.
var ErrInvalidRequestID = errors.New("invalid X-Request-Id: use 1 to 256 printable ASCII characters (space to '~')")

// RequestKey maps a client's X-Request-Id to the request's key: the id of
// its record, the token of its subjects, its Nats-Msg-Id, and the
// X-Request-Id of both engine legs. Any printable ASCII id (0x20 to 0x7E)
// of 1 to [MaxClientIDLen] bytes is taken; anything else (empty, longer,
// control characters, other bytes) is [ErrInvalidRequestID].
//
// A subject-safe id ([A-Za-z0-9_-], at most 124 bytes) is its own key, so
// that records, subjects and engine logs show the client's id. Any other
// (req.1:abc, "a b", a longer one, or one that starts with "pdqid_") is
// hashed: "pdqid_" and 32 hex digits of its SHA-256. The mapping is a
// function of the id alone, so the same id always meets its earlier
// request (a 409, a retry) and its record.
//
// Engines get the key, not the client's id: the two legs must carry the
// same X-Request-Id, and the key is what the job carries everywhere; it
// is a plain token that no proxy, log format or engine-side parser
// between pdq and vLLM can take apart (vLLM builds its internal ids and
// its NIXL notifications, "<id>:<tp size>", from it). The gateway puts
// the client's own id back into the response ids it relays.
func RequestKey(clientID string) (string, error) {
	if len(clientID) < 1 || len(clientID) > MaxClientIDLen {
		return "", ErrInvalidRequestID
	}
	for i := range len(clientID) {
		if c := clientID[i]; c < 0x20 || c > 0x7e {
			return "", ErrInvalidRequestID
		}
	}
	if len(clientID) <= maxKeptIDLen && validID(clientID) && !strings.HasPrefix(clientID, hashedKeyPrefix) {
		return clientID, nil
	}
	sum := sha256.Sum256([]byte(clientID))
	return hashedKeyPrefix + hex.EncodeToString(sum[:16]), nil
}

// LookupKeys are the keys a request that someone names by id may be
// recorded under, in the order to try: its key (RequestKey), then id
// itself when that differs and is a key already (a hashed one, or a
// batched prompt's <key>-<i>, as records and pdq requests show them).
// None for an id RequestKey refuses.
func LookupKeys(id string) []string {
	var keys []string
	if key, err := RequestKey(id); err == nil {
		keys = append(keys, key)
	}
	if ValidRequestID(id) && (len(keys) == 0 || keys[0] != id) {
		keys = append(keys, id)
	}
	return keys
}

// ValidPool reports whether pool may be used as a pool's subject token.
func ValidPool(pool string) bool { return validID(pool) && len(pool) <= 73 }

// PoolName turns a model name into the subject token and consumer-name part
// of its pool. Characters that NATS gives meaning to ('.', '*', '>', '/',
// spaces, ...) become '_', and a short hash of the model name is appended
// whenever anything was replaced, so two models never share a pool:
// "pdq-sim" stays "pdq-sim", "meta-llama/Llama-3.1-8B" becomes
// "meta-llama_Llama-3_1-8B-<hash>".
func PoolName(model string) string {
	var b strings.Builder
	changed := model == ""
	for _, r := range model {
		if r < 128 && (r == '-' || r == '_' || 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9') {
			b.WriteRune(r)
			continue
		}
		b.WriteByte('_')
		changed = true
	}
	name := b.String()
	if len(name) > 64 {
		name, changed = name[:64], true
	}
	if changed {
		sum := sha256.Sum256([]byte(model))
		name += "-" + hex.EncodeToString(sum[:4])
	}
	return name
}

// Token is a random subject-safe token, for the ids of workers, deliveries
// and probes.
func Token() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// The worker registry's subjects: heartbeats, the ask for them, and a
// worker's last word.
const (
	subjectWorkers = "pdq.workers"
	// WorkersAskSubject asks every worker for a heartbeat now.
	WorkersAskSubject = subjectWorkers + ".ask"
	// HeaderLeaving marks a worker's last message: it stops pulling.
	HeaderLeaving = "Pdq-Leaving"
)

// WorkerSubject is where worker id sends its heartbeats; worker ids never
// collide with "ask".
func WorkerSubject(id string) string { return subjectWorkers + "." + id }

// QueuesSubject is where one worker of pool's stage loops publishes what
// the pool's queues of stage hold (dispatcher/queues): the take-over, the
// decode gates and the queue-depth metric of the others read it instead
// of each listing the consumers.
func QueuesSubject(stage Stage, pool string) string {
	return "pdq.queues." + string(stage) + "." + pool
}

// QueuesAskSubject is where a decode gate whose report is older than it
// can use asks the pool's reporter, by its id, to list and publish now.
func QueuesAskSubject(stage Stage, pool, reporter string) string {
	return QueuesSubject(stage, pool) + ".ask." + reporter
}

// KeeperNote is a keeper's body, for whoever reads the stream.
const KeeperNote = "pdq: kept so that the stream's last file block never empties; no worker takes it"

// KeeperSubject is where stage's stream keeps its keeper.
func KeeperSubject(stage Stage) string { return StageSubject(stage) + ".keep" }
