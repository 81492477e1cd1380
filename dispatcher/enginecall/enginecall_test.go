package enginecall

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

func TestEngineCalls(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	ctx := context.Background()
	started := make(chan Request, 1)
	stopped := make(chan error, 1)
	calls, err := Serve(nc, "w1", 2, func(ctx context.Context, call Request) Answer {
		if call.Path == "/slow" {
			started <- call
			<-ctx.Done()
			stopped <- ctx.Err()
			return Answer{Status: 200}
		}
		return Answer{Status: 201, ContentType: "text/plain", Body: []byte(call.Method + " " + call.Path + " " + string(call.Body))}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer calls.Stop(time.Second)

	a, err := Call(ctx, nc, "w1", Request{ID: "c1", Method: "POST", Path: "/tokenize?x=1", Body: []byte(`{"a":1}`)})
	if err != nil || a.Status != 201 || a.ContentType != "text/plain" || string(a.Body) != `POST /tokenize?x=1 {"a":1}` {
		t.Errorf("answer %+v, %v", a, err)
	}
	if _, err := Call(ctx, nc, "nobody", Request{ID: "c2", Method: "GET", Path: "/version"}); !errors.Is(err, ErrNoAnswer) {
		t.Errorf("a call to no worker: %v, want ErrNoAnswer", err)
	}

	// A caller that goes away cancels the call: the engine's work stops.
	cctx, cancel := context.WithCancel(ctx)
	go Call(cctx, nc, "w1", Request{ID: "c3", Method: "POST", Path: "/slow"})
	select {
	case call := <-started:
		if call.ID != "c3" {
			t.Errorf("call id %q", call.ID)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the slow call never started")
	}
	cancel()
	if err := nc.Publish(dispatcher.CancelSubject("c3"), nil); err != nil {
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
	go Call(dctx, nc, "w1", Request{ID: "c4", Method: "POST", Path: "/slow"})
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

// TestEngineCallsForNobody: calls whose callers gave up (their deadline)
// while they waited for the engine never reach it, and more than 4×limit
// waiting are refused at once. (Found by review.)
func TestEngineCallsForNobody(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	ctx := context.Background()
	release, slow := make(chan struct{}), make(chan struct{})
	var ran atomic.Int32
	calls, err := Serve(nc, "w1", 1, func(ctx context.Context, call Request) Answer {
		if call.Path == "/slow" {
			close(slow)
			<-release
			return Answer{Status: 200}
		}
		ran.Add(1)
		return Answer{Status: 200}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer calls.Stop(time.Second)
	go Call(ctx, nc, "w1", Request{ID: "slow", Method: "POST", Path: "/slow"})
	<-slow
	for i := range 20 {
		cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, err := Call(cctx, nc, "w1", Request{ID: "late-" + strconv.Itoa(i), Method: "POST", Path: "/tokenize"})
		cancel()
		if !errors.Is(err, ErrNoAnswer) {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	dispatchertest.WaitFor(t, "the late calls given up", func() bool { return calls.waiting.Load() == 0 })
	// Four waiting at once fill the queue (4×limit); the fifth is refused.
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			Call(cctx, nc, "w1", Request{ID: "queued-" + strconv.Itoa(i), Method: "POST", Path: "/tokenize"})
		})
	}
	dispatchertest.WaitFor(t, "four calls waiting", func() bool { return calls.waiting.Load() == 4 })
	if a, err := Call(ctx, nc, "w1", Request{ID: "over", Method: "POST", Path: "/tokenize"}); err != nil || a.Status != 503 {
		t.Errorf("a call past the queue: %+v, %v; want a 503", a, err)
	}
	close(release)
	wg.Wait()
	if n := ran.Load(); n != 4 {
		t.Errorf("%d engine calls ran, want the 4 whose callers still waited", n)
	}
}

// TestEngineCallsAfterStop: calls queued when Stop is called are answered
// 503 and never reach the engine. (Found by review.)
func TestEngineCallsAfterStop(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	ctx := context.Background()
	var stoppedAt atomic.Int64
	var late atomic.Int32
	calls, err := Serve(nc, "w1", 1, func(ctx context.Context, call Request) Answer {
		if s := stoppedAt.Load(); s != 0 {
			late.Add(1)
		}
		time.Sleep(300 * time.Millisecond)
		return Answer{Status: 200}
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		go Call(ctx, nc, "w1", Request{ID: "s" + string(rune('0'+i)), Method: "GET", Path: "/version"})
	}
	dispatchertest.WaitFor(t, "queued", func() bool { return calls.waiting.Load() == 2 })
	calls.Stop(100 * time.Millisecond)
	stoppedAt.Store(time.Now().UnixNano())
	time.Sleep(time.Second)
	if late.Load() > 0 {
		t.Errorf("%d engine calls started after Stop returned", late.Load())
	}
}
