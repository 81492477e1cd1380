package tests

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// setFault changes an engine's fault through POST /sim/faults.
func setFault(t *testing.T, e *simtest.Engine, f string) {
	t.Helper()
	post(t, e.URL+"/sim/faults", "", f).wantStatus(t, http.StatusOK)
}

// TestFaults injects each fault kind at rate 1 through the HTTP API and
// checks what a client sees, then that rate 0 turns faults off.
func TestFaults(t *testing.T) {
	b := chatBody(model, "fault me", body{"max_tokens": 6, "ignore_eos": true})
	streamed := b.clone()
	streamed["stream"] = true

	// Faults answered at once with an error of their own status and type.
	for _, tc := range []struct {
		kind, typ string
		status    int
	}{{"503", "ServiceUnavailableError", http.StatusServiceUnavailable}, {"429", "RateLimitError", http.StatusTooManyRequests}} {
		t.Run(tc.kind, func(t *testing.T) {
			e := simtest.Start(t, simtest.FastConfig())
			setFault(t, e, fmt.Sprintf(`{"rate":1,"kind":%q}`, tc.kind))
			r := post(t, e.URL+openai.Chat.Path(), "", b)
			r.wantStatus(t, tc.status)
			if r.apiError(t).Type != tc.typ {
				t.Errorf("body = %s", r.body)
			}
			checkOff(t, e, b)
		})
	}

	t.Run("500", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		setFault(t, e, `{"rate":1,"kind":"500"}`)
		r := postStream(t, e.URL+openai.Chat.Path(), "", streamed)
		if r.status != http.StatusInternalServerError {
			t.Errorf("streamed request: status %d, want 500 before the stream starts", r.status)
		}
		post(t, e.URL+openai.Chat.Path(), "", b).wantStatus(t, http.StatusInternalServerError)
		checkOff(t, e, b)
	})

	t.Run("hang", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		setFault(t, e, `{"rate":1,"kind":"hang"}`)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		_, err := send(ctx, e.URL+openai.Chat.Path(), "", b)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want the client's deadline", err)
		}
		e.WaitStats(t, 5*time.Second, "abort", func(s sim.Stats) bool { return s.Aborts == 1 })
		checkOff(t, e, b)
	})

	t.Run("drop", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		setFault(t, e, `{"rate":1,"kind":"drop"}`)
		s := postStream(t, e.URL+openai.Chat.Path(), "", streamed)
		if s.status != http.StatusOK || s.done || !errors.Is(s.err, io.ErrUnexpectedEOF) {
			t.Errorf("streamed: status %d, done %v, err %v; want a stream cut without [DONE]", s.status, s.done, s.err)
		}
		if len(s.events) == 0 || len(s.events) > 4 {
			t.Errorf("streamed: %d events before the drop, want some but not all", len(s.events))
		}
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if resp, err := send(ctx, e.URL+openai.Chat.Path(), "", b); err == nil {
			resp.Body.Close()
			t.Errorf("non-streamed: got status %d, want the connection closed", resp.StatusCode)
		}
		if st := e.Stats(t); st.Faults != 2 {
			t.Errorf("faults = %d, want 2", st.Faults)
		}
		checkOff(t, e, b)
	})

	t.Run("no-kv", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		setFault(t, e, `{"rate":1,"kind":"no-kv"}`)
		res, params := parseResponse(t, post(t, e.URL+openai.Chat.Path(), "req-1", prefillBody(b)))
		if string(params) != "null" || res.usage.CompletionTokens != 1 {
			t.Errorf("prefill with no-kv: params %s, %d tokens; want 200, null params", params, res.usage.CompletionTokens)
		}
		if s := e.Stats(t); s.BlocksHeld != 0 || s.Faults != 1 {
			t.Errorf("stats = %+v", s)
		}
		// A plain request is untouched by no-kv.
		parseResponse(t, post(t, e.URL+openai.Chat.Path(), "", b))
		checkOff(t, e, b)
	})

	t.Run("slow", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		setFault(t, e, `{"rate":1,"kind":"slow","delay":"150ms"}`)
		start := time.Now()
		s := postStream(t, e.URL+openai.Chat.Path(), "", streamed)
		if elapsed := time.Since(start); elapsed < 150*time.Millisecond {
			t.Errorf("slow response came after %v, before the 150ms delay", elapsed)
		}
		parseStream(t, s, openai.Chat, false)
		checkOff(t, e, b)
	})

	t.Run("late", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		setFault(t, e, `{"rate":1,"kind":"late","delay":"1s"}`)
		start := time.Now()
		answer := make(chan response, 1)
		go func() { answer <- post(t, e.URL+openai.Chat.Path(), "", b) }()
		// The work is done while the answer waits (slow waits before it).
		e.WaitStats(t, 10*time.Second, "the work done", func(s sim.Stats) bool { return s.GenerationTokens == 6 })
		select {
		case <-answer:
			t.Errorf("the answer came with the work, %v after the request, not 1s late", time.Since(start))
		default:
		}
		r := <-answer
		if elapsed := time.Since(start); elapsed < time.Second {
			t.Errorf("late answer came after %v, before the 1s delay", elapsed)
		}
		parseResponse(t, r)
		if s := e.Stats(t); s.Faults != 1 || s.GenerationTokens != 6 {
			t.Errorf("stats = %+v, want 1 fault and the work done", s)
		}
		checkOff(t, e, b)
	})

	t.Run("from flags, at a rate", func(t *testing.T) {
		cfg := simtest.FastConfig()
		cfg.Fault = simconfig.Fault{Rate: 0.5, Kind: simconfig.Fault503}
		e := simtest.Start(t, cfg)
		failed := 0
		const n = 100
		for range n {
			if post(t, e.URL+openai.Completions.Path(), "", completionBody(model, "x", body{"max_tokens": 1})).status == http.StatusServiceUnavailable {
				failed++
			}
		}
		if failed < 25 || failed > 75 {
			t.Errorf("%d of %d requests failed at rate 0.5", failed, n)
		}
		if s := e.Stats(t); s.Faults != int64(failed) || s.Local != int64(n-failed) {
			t.Errorf("stats = %+v, want %d faults", s, failed)
		}
	})

	t.Run("bad fault requests", func(t *testing.T) {
		e := simtest.Start(t, simtest.FastConfig())
		for _, f := range []string{`{"rate":2,"kind":"503"}`, `{"rate":1,"kind":"explode"}`, `{"kind":"503"}`, `{"rate":1,"kind":"slow","delay":"soon"}`, `{"rate":1,"kind":"503","extra":1}`, `nope`} {
			r := post(t, e.URL+"/sim/faults", "", f)
			r.wantStatus(t, http.StatusBadRequest)
			r.apiError(t)
		}
		r := get(t, e.URL+"/sim/faults")
		if !strings.Contains(string(r.body), `"rate":0`) {
			t.Errorf("a refused change took effect: %s", r.body)
		}
	})
}

// checkOff turns faults off and checks that the engine serves again.
func checkOff(t *testing.T, e *simtest.Engine, b body) {
	t.Helper()
	setFault(t, e, `{"rate":0}`)
	parseResponse(t, post(t, e.URL+openai.Chat.Path(), "", b))
}
