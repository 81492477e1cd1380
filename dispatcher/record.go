package dispatcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/internal/jsapi"
	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// State is where a request stands in its record.
type State string

// The states a record holds. Prefilling and decoding are not written on
// the hot path: GET /v1/requests/{id} reads them from where the request's
// message sits.
const (
	StateQueued     State = "queued"
	StatePrefilling State = "prefilling"
	StateDecoding   State = "decoding"
	StateDone       State = "done"
	StateFailed     State = "failed"
	StateCancelled  State = "cancelled"
	StateExpired    State = "expired"
)

// Ended reports whether the request has ended: no stage may run it again
// unless it is retried or replayed as a new generation.
func (s State) Ended() bool {
	switch s {
	case StateDone, StateFailed, StateCancelled, StateExpired:
		return true
	}
	return false
}

// Record is a request's entry in the pdq_requests bucket, keyed by its id.
// A request that succeeds is written twice: when the gateway accepts it and
// when it has delivered the answer.
type Record struct {
	// ID is the request's key (see [RequestKey]).
	ID string `json:"id"`
	// ClientID is the client's X-Request-Id when it is not the key itself
	// (an id that is not a subject token): what the client knows the
	// request by.
	ClientID   string          `json:"client_id,omitempty"`
	State      State           `json:"state"`
	Generation int             `json:"generation"`
	Model      string          `json:"model"`
	Pool       string          `json:"pool"`
	Endpoint   openai.Endpoint `json:"endpoint"`
	Stream     bool            `json:"stream"`
	// DecodeOnly is set when the request skipped prefill.
	DecodeOnly bool `json:"decode_only,omitempty"`
	// Prompts is set on the record of a batched completions request: its
	// prompts run as the requests <id>-0 to <id>-<Prompts-1>, each with a
	// record of its own, and this one holds the id for the whole batch.
	Prompts int `json:"prompts,omitempty"`
	// Owner names the API key that made the request (Job.Owner): with API
	// keys, only that key, or an operator key, reads the record.
	Owner string `json:"owner,omitempty"`
	// Gateway is the id of the gateway that holds the client; empty for a
	// replay.
	Gateway  string    `json:"gateway,omitempty"`
	Created  time.Time `json:"created"`
	Updated  time.Time `json:"updated"`
	Deadline time.Time `json:"deadline"`
	// Error is why the request failed, was cancelled or expired.
	Error *RecordError `json:"error,omitempty"`
	// Stages are the stage runs that led to the answer; on a request that
	// failed, was cancelled or expired in a stage, those of its last
	// generation up to there (the last one is where it ended).
	Stages []StageRecord `json:"stages,omitempty"`
	// Replays counts the runs started by pdq replay.
	Replays int `json:"replays,omitempty"`
	// Result is a replay's answer: the engine's JSON response, or the
	// stream's events assembled into one.
	Result json.RawMessage `json:"result,omitempty"`
}

// RecordError is the error a request ended with: the status and message
// its client got, or would have got.
type RecordError struct {
	Status  int    `json:"status"`
	Message string `json:"message"`
	// Stage is where it failed, when a stage did.
	Stage Stage `json:"stage,omitempty"`
}

// Live reports whether the record's request may still run.
func (r *Record) Live() bool { return !r.State.Ended() }

// Records is the pdq_requests bucket.
type Records struct {
	kv jetstream.KeyValue
	nc *nats.Conn
	// get is the subject of a direct get of a record, but for its key.
	get     string
	timeout time.Duration // a read's, when its context has no deadline
}

// OpenRecords opens the bucket that Ensure created.
func OpenRecords(ctx context.Context, js jetstream.JetStream) (*Records, error) {
	kv, err := js.KeyValue(ctx, BucketRequests)
	if err != nil {
		return nil, fmt.Errorf("open request records: %w", err)
	}
	o := js.Options()
	return &Records{kv: kv, nc: js.Conn(), timeout: jsapi.Timeout(o),
		get: jsapi.Prefix(o) + "DIRECT.GET.KV_" + BucketRequests + ".$KV." + BucketRequests + "."}, nil
}

// ErrNoRecord means no request with this id is recorded (never accepted, or
// older than the bucket's TTL).
var ErrNoRecord = errors.New("no such request")

// Get reads id's record and its revision.
func (rs *Records) Get(ctx context.Context, id string) (*Record, uint64, error) {
	return rs.GetChanged(ctx, id, 0)
}

// GetChanged is Get, unless the record's revision is still rev (when rev
// is not 0): then it returns a nil record, without decoding it. On the hot
// path nothing writes a record between its claim and its end, and the
// decode is about a quarter of the time of a stage's read at admission,
// and 11 of its 76 allocations (BenchmarkRecordRead).
func (rs *Records) GetChanged(ctx context.Context, id string, rev uint64) (*Record, uint64, error) {
	data, last, err := rs.read(ctx, id)
	if err != nil {
		return nil, 0, err
	}
	if rev != 0 && last == rev {
		return nil, rev, nil
	}
	var r Record
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, 0, fmt.Errorf("record %s: %w", id, err)
	}
	return &r, last, nil
}

// read returns id's record as stored, and its revision. It asks the
// bucket's stream itself, with a direct get, as the KeyValue's Get does,
// without the JSON request that Get encodes and nobody reads, and the
// entry it builds: 11 of the 87 allocations of a read through Get, and up
// to a fifth of its time (BenchmarkRecordRead).
// Where no server answers direct gets, it falls back on that Get.
func (rs *Records) read(ctx context.Context, id string) ([]byte, uint64, error) {
	if !ValidRequestID(id) {
		return nil, 0, fmt.Errorf("read record %q: %w", id, jetstream.ErrInvalidKey)
	}
	ctx, cancel := jsapi.Bounded(ctx, rs.timeout)
	defer cancel()
	m, err := rs.nc.RequestWithContext(ctx, rs.get+id, nil)
	if errors.Is(err, nats.ErrNoResponders) {
		return rs.readEntry(ctx, id)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read record %s: %w", id, err)
	}
	if status := m.Header.Get("Status"); len(m.Data) == 0 && status != "" {
		if status == "404" {
			return nil, 0, ErrNoRecord
		}
		return nil, 0, fmt.Errorf("read record %s: %s %s", id, status, m.Header.Get("Description"))
	}
	if deleteMarker(m.Header) {
		return nil, 0, ErrNoRecord
	}
	last, err := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
	if err != nil {
		return nil, 0, fmt.Errorf("read record %s: the revision: %w", id, err)
	}
	return m.Data, last, nil
}

// deleteMarker reports whether a key's last message marks it deleted or
// purged, as the KeyValue's Get reads it: by its operation, or else by
// the reason the server gave for a marker.
func deleteMarker(h nats.Header) bool {
	if op := h.Get(KVOperation); op != "" {
		return op == "DEL" || op == "PURGE"
	}
	switch h.Get(jetstream.MarkerReasonHeader) {
	case "MaxAge", "Purge", "Remove":
		return true
	}
	return false
}

// KVOperation is the header of a KeyValue's delete and purge markers.
const KVOperation = "KV-Operation"

// readEntry is read through the KeyValue's Get.
func (rs *Records) readEntry(ctx context.Context, id string) ([]byte, uint64, error) {
	e, err := rs.kv.Get(ctx, id)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, ErrNoRecord
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read record %s: %w", id, err)
	}
	return e.Value(), e.Revision(), nil
}

// Create writes a new record; it fails with jetstream.ErrKeyExists when id
// has one.
func (rs *Records) Create(ctx context.Context, r *Record) (uint64, error) {
	data, err := json.Marshal(r)
	if err != nil {
		return 0, fmt.Errorf("encode record %s: %w", r.ID, err)
	}
	return whileNoLeader(ctx, func() (uint64, error) { return rs.kv.Create(ctx, r.ID, data) })
}

// Update writes r over the revision read; it fails with
// jetstream.ErrKeyExists (wrong last sequence) when another write came in
// between.
func (rs *Records) Update(ctx context.Context, r *Record, rev uint64) (uint64, error) {
	r.Updated = time.Now()
	data, err := json.Marshal(r)
	if err != nil {
		return 0, fmt.Errorf("encode record %s: %w", r.ID, err)
	}
	return whileNoLeader(ctx, func() (uint64, error) { return rs.kv.Update(ctx, r.ID, data, rev) })
}

// whileNoLeader retries a record write that found no leader for the bucket
// (its node lost; see PublishFailover): nothing was written, so the same
// compare-and-set is tried again. A write that got no answer at all is not
// retried: it may have been stored, and a second try would fail its
// revision check as if another writer had come in between.
func whileNoLeader(ctx context.Context, write func() (uint64, error)) (uint64, error) {
	giveUp := time.Now().Add(PublishFailover)
	for {
		rev, err := write()
		if err == nil || !errors.Is(err, jetstream.ErrNoStreamResponse) || time.Now().After(giveUp) {
			return rev, err
		}
		if sleep.For(ctx, publishRetryWait) != nil {
			return rev, err
		}
	}
}

// ErrNoChange is returned by a Transition's change to leave the record as
// it is.
var ErrNoChange = errors.New("no change")

// Transition applies change to id's current record and writes it back,
// compare-and-set, reading again when another write won the race. change
// returns ErrNoChange to leave the record alone. It returns the record as
// written (or as left).
func (rs *Records) Transition(ctx context.Context, id string, change func(*Record) error) (*Record, error) {
	return rs.transition(ctx, id, nil, 0, change)
}

// TransitionFrom is Transition starting from rec, the record as a claim
// wrote it at revision rev: when no other write came since, the change is
// written without reading the record first. A revision not known (0)
// makes it a plain Transition.
func (rs *Records) TransitionFrom(ctx context.Context, rec *Record, rev uint64, change func(*Record) error) (*Record, error) {
	return rs.transition(ctx, rec.ID, rec, rev, change)
}

// transition is Transition whose first try, when rev is not 0, starts
// from a copy of from, taken to be the record at revision rev.
func (rs *Records) transition(ctx context.Context, id string, from *Record, rev uint64, change func(*Record) error) (*Record, error) {
	for range 5 {
		var r *Record
		if rev != 0 {
			cp := *from // the claim stays as it was written
			r = &cp
		} else {
			var err error
			if r, rev, err = rs.Get(ctx, id); err != nil {
				return nil, err
			}
		}
		if err := change(r); err != nil {
			if errors.Is(err, ErrNoChange) {
				return r, nil
			}
			return r, err
		}
		if _, err := rs.Update(ctx, r, rev); err != nil {
			if IsWrongRevision(err) {
				rev = 0 // written since: read what is there
				continue
			}
			return nil, fmt.Errorf("write record %s: %w", id, err)
		}
		return r, nil
	}
	return nil, fmt.Errorf("write record %s: too many concurrent writes", id)
}

// End moves id's generation to an ended state, with the stage runs that
// led there, unless the record has moved on to a later generation or
// already ended (one that ended without stage runs gets these). The record may still name an earlier generation: a new
// generation's job is stored before it is recorded.
func (rs *Records) End(ctx context.Context, id string, generation int, state State, e *RecordError, stages ...StageRecord) error {
	_, err := rs.Transition(ctx, id, func(r *Record) error {
		switch {
		case r.Generation > generation:
			return ErrNoChange
		case r.State.Ended() && r.Generation == generation && len(r.Stages) == 0 && len(stages) > 0:
			// Ended by its gateway first (a client gone, a deadline, a
			// silent stream): the state stays the gateway's, and the
			// stage runs are the worker's to add.
			r.Stages = stages
			return nil
		case r.State.Ended():
			return ErrNoChange
		}
		r.State, r.Generation, r.Error = state, generation, e
		if len(stages) > 0 {
			r.Stages = stages
		}
		return nil
	})
	if errors.Is(err, ErrNoRecord) {
		return nil // expired from the bucket: nothing to mark
	}
	return err
}

// List calls f with each record, until f returns false.
func (rs *Records) List(ctx context.Context, f func(*Record) bool) error {
	keys, err := rs.kv.ListKeys(ctx)
	if err != nil {
		return fmt.Errorf("list records: %w", err)
	}
	defer keys.Stop()
	for id := range keys.Keys() {
		if !ValidRequestID(id) {
			continue // not pdq's: written by hand
		}
		r, _, err := rs.Get(ctx, id)
		if errors.Is(err, ErrNoRecord) {
			continue
		}
		if err != nil {
			return err
		}
		if !f(r) {
			return nil
		}
	}
	return nil
}

func IsWrongRevision(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant) {
		return true
	}
	return errors.Is(err, jetstream.ErrKeyExists)
}

// ReadRecord reads the record of the request someone names by id, for a
// person or a script: id is the client's X-Request-Id or the key it runs
// under (see LookupKeys); one that is neither is ErrInvalidRequestID. A
// live request's state is refined from where its message sits: in the
// prefill stage, or in the decode stage.
func ReadRecord(ctx context.Context, js jetstream.StreamManager, rs *Records, id string) (*Record, error) {
	keys := LookupKeys(id)
	if len(keys) == 0 {
		return nil, fmt.Errorf("%q: %w", id, ErrInvalidRequestID)
	}
	err := ErrNoRecord
	for _, key := range keys {
		var r *Record
		if r, err = readRecord(ctx, js, rs, key); !errors.Is(err, ErrNoRecord) {
			return r, err
		}
	}
	return nil, err
}

// readRecord is ReadRecord of the record under key.
func readRecord(ctx context.Context, js jetstream.StreamManager, rs *Records, id string) (*Record, error) {
	r, _, err := rs.Get(ctx, id)
	if err != nil || r.State != StateQueued {
		return r, err
	}
	for _, stage := range []Stage{StageDecode, StagePrefill} {
		st, err := js.Stream(ctx, StageStream(stage))
		if err != nil {
			return nil, fmt.Errorf("read stream %s: %w", StageStream(stage), err)
		}
		for _, subject := range JobSubjects(stage, r.Pool, id) {
			if _, err := st.GetLastMsgForSubject(ctx, subject); err == nil {
				r.State = StatePrefilling
				if stage == StageDecode {
					r.State = StateDecoding
				}
				return r, nil
			} else if !errors.Is(err, jetstream.ErrMsgNotFound) {
				return nil, fmt.Errorf("read stream %s: %w", StageStream(stage), err)
			}
		}
	}
	return r, nil
}
