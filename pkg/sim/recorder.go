package sim

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// The recorder keeps what reached the engine, for tests to compare with
// what a client sent: every request but /sim/*, with its exact body, under
// its X-Request-Id. Memory is bounded: the last recordIDs ids, recordPerID
// requests each, recordBytes of bodies in all (the oldest ids go first).
const (
	recordIDs    = 512
	recordPerID  = 64
	recordBytes  = 256 << 20
	recordRecent = 64
)

// RecordedRequest is one request as the engine received it, served by
// GET /sim/requests.
type RecordedRequest struct {
	// Seq numbers the requests in arrival order, from 1.
	Seq    int64     `json:"seq"`
	Time   time.Time `json:"time"`
	Method string    `json:"method"`
	Path   string    `json:"path"`
	// ID is the X-Request-Id header, "" if none.
	ID string `json:"id"`
	// HasAuth reports whether an Authorization header came with it.
	HasAuth bool `json:"has_auth"`
	// BodyBytes is the length of the body.
	BodyBytes int `json:"body_bytes"`
	// Body is the body, byte for byte (base64 in JSON). It is left out of
	// the list of recent requests.
	Body []byte `json:"body,omitempty"`
}

// RecordedRequests is the answer of GET /sim/requests: the requests of one
// X-Request-Id with their bodies (?id=X), or the last 64 of all without.
type RecordedRequests struct {
	ID       *string           `json:"id,omitempty"`
	Requests []RecordedRequest `json:"requests"`
}

type recorder struct {
	mu     sync.Mutex
	seq    int64
	byID   map[string][]*RecordedRequest
	order  []string // ids, oldest first
	bytes  int
	recent []*RecordedRequest // ring of the last recordRecent
	next   int
}

func newRecorder() *recorder {
	return &recorder{byID: make(map[string][]*RecordedRequest)}
}

func (rc *recorder) add(req *RecordedRequest) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.seq++
	req.Seq = rc.seq
	list, known := rc.byID[req.ID]
	if !known {
		rc.order = append(rc.order, req.ID)
	}
	if len(list) >= recordPerID {
		rc.bytes -= len(list[0].Body)
		list = list[1:]
	}
	rc.byID[req.ID] = append(list, req)
	rc.bytes += len(req.Body)
	for len(rc.order) > 1 && (len(rc.order) > recordIDs || rc.bytes > recordBytes) {
		old := rc.order[0]
		rc.order = rc.order[1:]
		for _, r := range rc.byID[old] {
			rc.bytes -= len(r.Body)
		}
		delete(rc.byID, old)
	}
	if len(rc.recent) < recordRecent {
		rc.recent = append(rc.recent, req)
	} else {
		rc.recent[rc.next] = req
		rc.next = (rc.next + 1) % recordRecent
	}
}

func (rc *recorder) get(id string) []RecordedRequest {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make([]RecordedRequest, 0, len(rc.byID[id]))
	for _, r := range rc.byID[id] {
		out = append(out, *r)
	}
	return out
}

func (rc *recorder) last() []RecordedRequest {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make([]RecordedRequest, 0, len(rc.recent))
	for i := range rc.recent {
		r := *rc.recent[(rc.next+i)%len(rc.recent)]
		r.Body = nil
		out = append(out, r)
	}
	return out
}

// record wraps the routes: it reads each request's body at arrival (so the
// record is there before any answer), keeps it, and hands the handler the
// same bytes, and the same error if reading failed.
func (e *Engine) record(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/sim/") {
			next.ServeHTTP(w, r)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
		var tooBig *http.MaxBytesError
		if err == nil || errors.As(err, &tooBig) {
			// A body cut off by the client is not recorded: it never
			// reached the engine whole.
			e.recorder.add(&RecordedRequest{Time: time.Now(), Method: r.Method, Path: r.URL.Path,
				ID: r.Header.Get("X-Request-Id"), HasAuth: r.Header.Get("Authorization") != "",
				BodyBytes: len(body), Body: body})
		}
		var rest io.Reader = bytes.NewReader(body)
		if err != nil {
			rest = io.MultiReader(rest, errReader{err})
		}
		r.Body = io.NopCloser(rest)
		next.ServeHTTP(w, r)
	})
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// getRequests serves GET /sim/requests?id=X: the requests that came with
// X-Request-Id X, with their bodies, in arrival order (id= for those
// without one). Without id, the last 64 requests of all, without bodies.
func (e *Engine) getRequests(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	if !q.Has("id") {
		writeJSON(w, http.StatusOK, RecordedRequests{Requests: e.recorder.last()})
		return
	}
	id := q.Get("id")
	writeJSON(w, http.StatusOK, RecordedRequests{ID: &id, Requests: e.recorder.get(id)})
}
