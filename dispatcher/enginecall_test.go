package dispatcher

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestEngineCalls(t *testing.T) {
	nc, _ := startJetStream(t)
	ctx := context.Background()
	started := make(chan EngineCall, 1)
	stopped := make(chan error, 1)
	calls, err := ServeEngineCalls(ctx, nc, "w1", 2, func(ctx context.Context, call EngineCall) EngineAnswer {
		if call.Path == "/slow" {
			started <- call
			<-ctx.Done()
			stopped <- ctx.Err()
			return EngineAnswer{Status: 200}
		}
		return EngineAnswer{Status: 201, ContentType: "text/plain", Body: []byte(call.Method + " " + call.Path + " " + string(call.Body))}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer calls.Stop(time.Second)

	a, err := CallEngine(ctx, nc, "w1", EngineCall{ID: "c1", Method: "POST", Path: "/tokenize?x=1", Body: []byte(`{"a":1}`)})
	if err != nil || a.Status != 201 || a.ContentType != "text/plain" || string(a.Body) != `POST /tokenize?x=1 {"a":1}` {
		t.Errorf("answer %+v, %v", a, err)
	}
	if _, err := CallEngine(ctx, nc, "nobody", EngineCall{ID: "c2", Method: "GET", Path: "/version"}); !errors.Is(err, ErrNoAnswer) {
		t.Errorf("a call to no worker: %v, want ErrNoAnswer", err)
	}

	// A caller that goes away cancels the call: the engine's work stops.
	cctx, cancel := context.WithCancel(ctx)
	go CallEngine(cctx, nc, "w1", EngineCall{ID: "c3", Method: "POST", Path: "/slow"})
	select {
	case call := <-started:
		if call.ID != "c3" {
			t.Errorf("call id %q", call.ID)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the slow call never started")
	}
	cancel()
	if err := nc.Publish(CancelSubject("c3"), nil); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-stopped:
		if !strings.Contains(err.Error(), "canceled") {
			t.Errorf("the call stopped with %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the call ran on after its cancel")
	}

	// A caller's deadline bounds the engine's work too.
	dctx, dcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer dcancel()
	go CallEngine(dctx, nc, "w1", EngineCall{ID: "c4", Method: "POST", Path: "/slow"})
	<-started
	select {
	case err := <-stopped:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("the call stopped with %v, want its deadline", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the call ran on past its caller's deadline")
	}
}
