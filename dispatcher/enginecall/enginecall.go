package enginecall

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Engine calls are the vLLM endpoints a client of a P/D deployment expects
// besides generation (/tokenize, /detokenize, /version, /v1/embeddings):
// one engine answers each, so they need no queue. The gateway picks a
// healthy decode worker of the model from the registry and asks it over
// core NATS; the worker calls its engine with its own key and sends back
// the engine's status and body unchanged. Engines need not be reachable
// from the gateway, nor their key known to it.

// Headers of an engine call and its answer.
const (
	HeaderMethod      = "Pdq-Method"
	HeaderPath        = "Pdq-Path"
	HeaderContentType = "Pdq-Content-Type"
	// HeaderTimeout is the caller's time left, in milliseconds.
	HeaderTimeout = "Pdq-Timeout-Ms"
)

// subjectEngine prefixes the subjects where workers take engine calls.
const subjectEngine = "pdq.engine"

// Subject is where the worker with this id (WorkerInfo.WorkerID)
// takes engine calls.
func Subject(workerID string) string { return subjectEngine + "." + workerID }

// Request is a request to forward to an engine.
type Request struct {
	// ID names the call for its cancel broadcast (CancelSubject): a client
	// that goes away stops the engine's work.
	ID     string
	Method string
	Path   string // with its query, if any
	Body   []byte
}

// Answer is an engine's answer to a call.
type Answer struct {
	Status      int
	ContentType string
	Body        []byte
}

// ErrNoAnswer means the worker asked did not answer an engine call.
var ErrNoAnswer = errors.New("the worker did not answer")

// Call sends call to the worker workerID and waits for its engine's
// answer, within ctx.
func Call(ctx context.Context, nc *nats.Conn, workerID string, call Request) (Answer, error) {
	m := nats.NewMsg(Subject(workerID))
	m.Header.Set(dispatcher.HeaderID, call.ID)
	if d, ok := ctx.Deadline(); ok {
		m.Header.Set(HeaderTimeout, strconv.FormatInt(max(time.Until(d).Milliseconds(), 1), 10))
	}
	m.Header.Set(HeaderMethod, call.Method)
	m.Header.Set(HeaderPath, call.Path)
	m.Data = call.Body
	reply, err := nc.RequestMsgWithContext(ctx, m)
	if err != nil {
		if errors.Is(err, nats.ErrNoResponders) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) {
			return Answer{}, fmt.Errorf("%w: %w", ErrNoAnswer, err)
		}
		return Answer{}, err
	}
	status, err := strconv.Atoi(reply.Header.Get(dispatcher.HeaderStatus))
	if err != nil || status < 100 || status > 599 {
		return Answer{}, fmt.Errorf("engine call: the worker's answer has no status")
	}
	return Answer{Status: status, ContentType: reply.Header.Get(HeaderContentType), Body: reply.Data}, nil
}

// Server serves a worker's engine calls; Stop ends it.
//
// The subscription's callback (one goroutine: NATS hands a subscription
// its messages one at a time) admits each call and runs it in a goroutine
// of its own (serve). Stop may be called from any goroutine; a call after
// the first returns at once.
type Server struct {
	// sub is set by Serve once it has subscribed; only Stop
	// reads it.
	sub *nats.Subscription
	// waiting counts the calls admitted that wait for a slot. The callback
	// adds to it under mu, serve takes away without it: an atomic.
	waiting atomic.Int64
	// base ends the calls still running when Stop's grace is over. Set at
	// construction, read without a lock.
	base   context.Context
	cancel context.CancelFunc

	// mu guards stopped, and orders the WaitGroup's Add (in the callback)
	// before Stop's Wait: once stopped is set, no call is added.
	mu       sync.Mutex
	stopped  bool
	stopping chan struct{} // made at construction, closed by Stop under mu
	wg       sync.WaitGroup
}

// engineCallWait is the longest an engine call may take when its caller
// sent no time-out.
const engineCallWait = 65 * time.Second

// errStopping answers the calls a stopping worker will not run.
var errStopping = ErrorAnswer(openai.NewError(http.StatusServiceUnavailable, "the decode worker is stopping; retry"))

// ErrorAnswer is an engine call's answer that is pdq's error, not the
// engine's.
func ErrorAnswer(e *openai.Error) Answer {
	body, err := e.Envelope()
	if err != nil { // plain fields: it always encodes
		body = []byte(`{"error":{}}`)
	}
	return Answer{Status: e.Status(), ContentType: "application/json", Body: body}
}

// Serve takes the engine calls sent to workerID and answers
// each with what do returns. do runs in a goroutine of its own, at most
// limit at a time, with a context that ends at the caller's deadline, at a
// cancel broadcast of the call's id, or at the end of Stop's grace. With
// 4×limit calls waiting, more are answered 503 at once.
func Serve(nc *nats.Conn, workerID string, limit int, do func(context.Context, Request) Answer) (*Server, error) {
	limit = max(limit, 1)
	sem := make(chan struct{}, limit)
	s := &Server{stopping: make(chan struct{})}
	s.base, s.cancel = context.WithCancel(context.Background())
	sub, err := nc.Subscribe(Subject(workerID), func(m *nats.Msg) {
		s.mu.Lock()
		if s.stopped {
			s.mu.Unlock()
			respond(m, errStopping)
			return
		}
		if s.waiting.Add(1) > int64(4*limit) {
			s.waiting.Add(-1)
			s.mu.Unlock()
			respond(m, ErrorAnswer(openai.NewError(http.StatusServiceUnavailable, "the decode worker has too many engine calls waiting; retry")))
			return
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serve(nc, m, sem, do)
		}()
	})
	if err != nil {
		s.cancel()
		return nil, err
	}
	s.sub = sub
	return s, nil
}

// serve runs one call: it waits for a slot, calls do, and answers.
func (s *Server) serve(nc *nats.Conn, m *nats.Msg, sem chan struct{}, do func(context.Context, Request) Answer) {
	call := Request{ID: m.Header.Get(dispatcher.HeaderID), Method: m.Header.Get(HeaderMethod), Path: m.Header.Get(HeaderPath), Body: m.Data}
	// The caller's time left, not its clock: the two clocks may differ.
	wait := engineCallWait
	if ms, err := strconv.ParseInt(m.Header.Get(HeaderTimeout), 10, 64); err == nil && ms > 0 {
		wait = time.Duration(ms) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(s.base, wait)
	defer cancel()
	if dispatcher.ValidRequestID(call.ID) {
		if sub, err := nc.Subscribe(dispatcher.CancelSubject(call.ID), func(*nats.Msg) { cancel() }); err == nil {
			defer sub.Unsubscribe()
		}
	}
	select {
	case sem <- struct{}{}:
		s.waiting.Add(-1)
		defer func() { <-sem }()
	case <-s.stopping:
		s.waiting.Add(-1)
		respond(m, errStopping)
		return
	case <-ctx.Done():
		s.waiting.Add(-1)
		return // the caller has given up
	}
	a := do(ctx, call)
	switch {
	case s.base.Err() != nil:
		respond(m, errStopping) // cut off at the end of the grace
	case ctx.Err() == nil:
		respond(m, a)
	}
}

// respond answers an engine call; an answer the server refuses (too large)
// becomes a short 502 that says so.
func respond(m *nats.Msg, a Answer) {
	r := nats.NewMsg(m.Reply)
	r.Header.Set(dispatcher.HeaderStatus, strconv.Itoa(a.Status))
	if a.ContentType != "" {
		r.Header.Set(HeaderContentType, a.ContentType)
	}
	r.Data = a.Body
	if err := m.RespondMsg(r); err != nil {
		a := ErrorAnswer(openai.NewError(http.StatusBadGateway, "the engine's answer could not be sent: %v", err))
		r.Data = a.Body
		r.Header.Set(dispatcher.HeaderStatus, strconv.Itoa(a.Status))
		r.Header.Set(HeaderContentType, a.ContentType)
		m.RespondMsg(r) // a lost answer is the caller's time-out
	}
}

// Stop takes no more calls (they are answered 503, as are those waiting
// for a slot), gives the running ones grace to finish, then cuts them off
// and waits for them.
func (s *Server) Stop(grace time.Duration) {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return
	}
	s.stopped = true
	close(s.stopping)
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
		s.cancel()
		<-done
	}
	s.cancel()
	_ = s.sub.Unsubscribe() // fails only on a closed connection, which takes no calls either
}
