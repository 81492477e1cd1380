package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
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
)

// subjectEngine prefixes the subjects where workers take engine calls.
const subjectEngine = "pdq.engine"

// EngineSubject is where the worker with this id (WorkerInfo.WorkerID)
// takes engine calls.
func EngineSubject(workerID string) string { return subjectEngine + "." + workerID }

// EngineCall is a request to forward to an engine.
type EngineCall struct {
	// ID names the call for its cancel broadcast (CancelSubject): a client
	// that goes away stops the engine's work.
	ID     string
	Method string
	Path   string // with its query, if any
	Body   []byte
}

// EngineAnswer is an engine's answer to a call.
type EngineAnswer struct {
	Status      int
	ContentType string
	Body        []byte
}

// ErrNoAnswer means the worker asked did not answer an engine call.
var ErrNoAnswer = errors.New("the worker did not answer")

// CallEngine sends call to the worker workerID and waits for its engine's
// answer, within ctx.
func CallEngine(ctx context.Context, nc *nats.Conn, workerID string, call EngineCall) (EngineAnswer, error) {
	m := nats.NewMsg(EngineSubject(workerID))
	m.Header.Set(HeaderID, call.ID)
	if d, ok := ctx.Deadline(); ok {
		m.Header.Set(HeaderDeadline, strconv.FormatInt(d.UnixMilli(), 10))
	}
	m.Header.Set(HeaderMethod, call.Method)
	m.Header.Set(HeaderPath, call.Path)
	m.Data = call.Body
	reply, err := nc.RequestMsgWithContext(ctx, m)
	if err != nil {
		if errors.Is(err, nats.ErrNoResponders) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) {
			return EngineAnswer{}, fmt.Errorf("%w: %w", ErrNoAnswer, err)
		}
		return EngineAnswer{}, err
	}
	status, err := strconv.Atoi(reply.Header.Get(HeaderStatus))
	if err != nil || status < 100 || status > 599 {
		return EngineAnswer{}, fmt.Errorf("engine call: the worker's answer has no status")
	}
	return EngineAnswer{Status: status, ContentType: reply.Header.Get(HeaderContentType), Body: reply.Data}, nil
}

// EngineCalls serves a worker's engine calls; Stop ends it.
type EngineCalls struct {
	sub     *nats.Subscription
	wg      sync.WaitGroup
	waiting atomic.Int64
}

// engineCallWait is the longest an engine call may take when its caller
// sent no deadline.
const engineCallWait = 65 * time.Second

// ServeEngineCalls takes the engine calls sent to workerID and answers
// each with what do returns. do runs in a goroutine of its own, at most
// limit at a time, with a context that ends at the caller's deadline or at
// a cancel broadcast of the call's id. With 4×limit calls waiting, more are
// answered 503 at once.
func ServeEngineCalls(ctx context.Context, nc *nats.Conn, workerID string, limit int, do func(context.Context, EngineCall) EngineAnswer) (*EngineCalls, error) {
	limit = max(limit, 1)
	sem := make(chan struct{}, limit)
	s := &EngineCalls{}
	sub, err := nc.Subscribe(EngineSubject(workerID), func(m *nats.Msg) {
		if s.waiting.Add(1) > int64(4*limit) {
			s.waiting.Add(-1)
			respond(m, EngineAnswer{Status: 503, ContentType: "application/json",
				Body: []byte(`{"error":{"message":"the decode worker has too many engine calls waiting; retry","type":"ServiceUnavailableError","param":null,"code":503}}`)})
			return
		}
		s.wg.Go(func() {
			call := EngineCall{ID: m.Header.Get(HeaderID), Method: m.Header.Get(HeaderMethod), Path: m.Header.Get(HeaderPath), Body: m.Data}
			deadline := time.Now().Add(engineCallWait)
			if ms, err := strconv.ParseInt(m.Header.Get(HeaderDeadline), 10, 64); err == nil {
				deadline = time.UnixMilli(ms)
			}
			cctx, cancel := context.WithDeadline(ctx, deadline)
			defer cancel()
			if ValidRequestID(call.ID) {
				if sub, err := nc.Subscribe(CancelSubject(call.ID), func(*nats.Msg) { cancel() }); err == nil {
					defer sub.Unsubscribe()
				}
			}
			select {
			case sem <- struct{}{}:
				s.waiting.Add(-1)
				defer func() { <-sem }()
			case <-cctx.Done():
				s.waiting.Add(-1)
				return // the caller has given up
			}
			a := do(cctx, call)
			if cctx.Err() == nil {
				respond(m, a)
			}
		})
	})
	if err != nil {
		return nil, err
	}
	s.sub = sub
	return s, nil
}

// respond answers an engine call; an answer the server refuses (too large)
// becomes a short 502 that says so.
func respond(m *nats.Msg, a EngineAnswer) {
	r := nats.NewMsg(m.Reply)
	r.Header.Set(HeaderStatus, strconv.Itoa(a.Status))
	if a.ContentType != "" {
		r.Header.Set(HeaderContentType, a.ContentType)
	}
	r.Data = a.Body
	if err := m.RespondMsg(r); err != nil {
		r.Data = []byte(`{"error":{"message":"the engine's answer could not be sent: ` + strings.ReplaceAll(err.Error(), `"`, `'`) + `","type":"BadGatewayError","param":null,"code":502}}`)
		r.Header.Set(HeaderStatus, "502")
		r.Header.Set(HeaderContentType, "application/json")
		m.RespondMsg(r) // a lost answer is the caller's time-out
	}
}

// Stop takes no more calls and waits, at most grace, for the calls under
// way to be answered.
func (s *EngineCalls) Stop(grace time.Duration) {
	s.sub.Unsubscribe()
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
	}
}
