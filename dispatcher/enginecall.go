package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

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

// ServeEngineCalls takes the engine calls sent to workerID and answers
// each with what do returns. do runs in a goroutine of its own, at most
// limit at a time, with a context that a cancel broadcast of the call's id
// ends. Unsubscribe the returned subscription to stop taking calls.
func ServeEngineCalls(ctx context.Context, nc *nats.Conn, workerID string, limit int, do func(context.Context, EngineCall) EngineAnswer) (*nats.Subscription, error) {
	sem := make(chan struct{}, max(limit, 1))
	return nc.Subscribe(EngineSubject(workerID), func(m *nats.Msg) {
		go func() {
			call := EngineCall{ID: m.Header.Get(HeaderID), Method: m.Header.Get(HeaderMethod), Path: m.Header.Get(HeaderPath), Body: m.Data}
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			if ValidRequestID(call.ID) {
				if sub, err := nc.Subscribe(CancelSubject(call.ID), func(*nats.Msg) { cancel() }); err == nil {
					defer sub.Unsubscribe()
				}
			}
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-cctx.Done():
				return
			}
			a := do(cctx, call)
			if cctx.Err() != nil {
				return // the caller is gone
			}
			r := nats.NewMsg(m.Reply)
			r.Header.Set(HeaderStatus, strconv.Itoa(a.Status))
			if a.ContentType != "" {
				r.Header.Set(HeaderContentType, a.ContentType)
			}
			r.Data = a.Body
			if err := m.RespondMsg(r); err != nil {
				// Too large for the server, say: a short answer says so.
				r.Data = []byte(`{"error":{"message":"the engine's answer could not be sent: ` + strings.ReplaceAll(err.Error(), `"`, `'`) + `","type":"BadGatewayError","param":null,"code":502}}`)
				r.Header.Set(HeaderStatus, "502")
				r.Header.Set(HeaderContentType, "application/json")
				m.RespondMsg(r) // a lost answer is the caller's time-out
			}
		}()
	})
}
