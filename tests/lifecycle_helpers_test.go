package tests

// Helpers of the lifecycle tests (lifecycle_test.go). Every name starts
// with lc so that none can clash with the other test files.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// lcClientTimeout bounds a lifecycle test's client request, so that a hang
// fails the test instead of stalling it.
const lcClientTimeout = 20 * time.Second

// lcRig is `pdq up` in front of a prefill and a decode `pdq sim` process.
type lcRig struct {
	up      *process
	url     string // pdq up's gateway
	prefill *simtest.Engine
	decode  *simtest.Engine
	pbase   sim.Stats // the prefill engine's counters once pdq up served its warm-up request
	dbase   sim.Stats // the same for the decode engine
}

// lcStart runs a prefill and a decode sim process with the given extra
// flags, and `pdq up` with env in front of them (one worker per engine).
// startUp sends one P/D warm-up request; pbase and dbase are the engines'
// counters after it, for tests to subtract.
func lcStart(t *testing.T, prefillArgs, decodeArgs []string, env ...string) *lcRig {
	t.Helper()
	_, p := startSimProcess(t, prefillArgs...)
	_, d := startSimProcess(t, decodeArgs...)
	env = append([]string{"PDQ_PREFILL_ENGINES=" + p.URL, "PDQ_DECODE_ENGINES=" + d.URL}, env...)
	up, url := startUp(t, env...)
	r := &lcRig{up: up, url: url, prefill: p, decode: d}
	// The warm-up request's KV read may still be releasing its blocks.
	r.pbase = p.WaitStats(t, 10*time.Second, "warm-up request settled", func(s sim.Stats) bool {
		return s.BlocksHeld == 0 && s.Running == 0
	})
	r.dbase = d.WaitStats(t, 10*time.Second, "warm-up request settled", func(s sim.Stats) bool {
		return s.Running == 0 && s.Waiting == 0
	})
	return r
}

func (r *lcRig) chat() string        { return r.url + "/v1/chat/completions" }
func (r *lcRig) completions() string { return r.url + "/v1/completions" }

// natsURL is the client URL of pdq up's embedded NATS (PDQ_NATS_LISTEN).
func (r *lcRig) natsURL(t *testing.T) string {
	t.Helper()
	u, _ := r.up.waitLog(t, "embedded NATS with JetStream started")["client_url"].(string)
	if u == "" {
		t.Fatalf("pdq up did not report a NATS client URL:\n%s", r.up.output())
	}
	return u
}

// lcDelta is after minus before for the counters; gauges (running,
// waiting, blocks held, engine dead) are after's.
func lcDelta(after, before sim.Stats) sim.Stats {
	d := after
	d.Requests -= before.Requests
	d.Prefills -= before.Prefills
	d.Decodes -= before.Decodes
	d.Local -= before.Local
	d.KVReads -= before.KVReads
	d.KVReadFailures -= before.KVReadFailures
	d.KVMismatches -= before.KVMismatches
	d.Recomputes -= before.Recomputes
	d.KVServed -= before.KVServed
	d.BlocksExpired -= before.BlocksExpired
	d.HoldsExpired -= before.HoldsExpired
	d.UnknownNotifs -= before.UnknownNotifs
	d.RequestIDMismatches -= before.RequestIDMismatches
	d.Aborts -= before.Aborts
	d.Faults -= before.Faults
	d.Errors -= before.Errors
	d.PromptTokens -= before.PromptTokens
	d.GenerationTokens -= before.GenerationTokens
	return d
}

// lcFinished is the number of generations an engine ran to their end.
func lcFinished(s sim.Stats) int64 { return s.Decodes + s.Local }

// lcSettle waits until the engine has been idle for a full second: nothing
// running or waiting, and no new request. It returns the counters and
// true then; it returns false at once when stop (if not nil) holds, or
// when timeout passes without a second of quiet.
func lcSettle(e *simtest.Engine, timeout time.Duration, stop func(sim.Stats) bool) (sim.Stats, bool, error) {
	deadline := time.Now().Add(timeout)
	var quietSince time.Time
	var quietRequests int64 = -1
	for {
		s, err := simtest.FetchStats(context.Background(), e.URL)
		if err != nil {
			return s, false, err
		}
		if stop != nil && stop(s) {
			return s, false, nil
		}
		if s.Running == 0 && s.Waiting == 0 && s.Requests == quietRequests {
			if time.Since(quietSince) >= time.Second {
				return s, true, nil
			}
		} else if s.Running == 0 && s.Waiting == 0 {
			quietSince, quietRequests = time.Now(), s.Requests
		} else {
			quietRequests = -1
		}
		if time.Now().After(deadline) {
			return s, false, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// lcWaitEngine polls the engine until cond holds or timeout passes, and
// returns the last counters and whether cond held. Unlike WaitStats it
// does not fail the test, so a test can report what it saw.
func lcWaitEngine(e *simtest.Engine, timeout time.Duration, cond func(sim.Stats) bool) (sim.Stats, bool) {
	s, err := e.Poll(timeout, cond)
	return s, err == nil
}

// lcLongPrompt is a prompt that goes through prefill (over 64 characters),
// made distinct by i.
func lcLongPrompt(i int) string { return fmt.Sprintf("%s (%d)", longPrompt, i) }

// lcShortPrompt is a prompt that skips prefill (under 64 characters).
func lcShortPrompt(i int) string { return fmt.Sprintf("Say hello, number %d.", i) }

// lcPostStream sends b and reads the SSE response to its end or until ctx
// ends. err is set when no response came (or ctx ended before its end).
func lcPostStream(ctx context.Context, url, id string, b any) (stream, error) {
	resp, err := send(ctx, url, id, b)
	if err != nil {
		return stream{}, err
	}
	defer resp.Body.Close()
	s := stream{status: resp.StatusCode, header: resp.Header}
	if resp.StatusCode != http.StatusOK {
		raw, err := io.ReadAll(resp.Body)
		s.events = [][]byte{raw}
		return s, err
	}
	r := openai.NewSSEReader(resp.Body)
	for {
		ev, err := r.Next()
		if err != nil {
			if ctx.Err() != nil {
				return s, ctx.Err()
			}
			if !errors.Is(err, io.EOF) {
				s.err = err
			}
			return s, nil
		}
		if ev.IsDone() {
			s.done = true
			continue
		}
		s.events = append(s.events, ev.Data)
	}
}

// lcInStreamError returns the error of a stream's last event, if it is an
// in-stream error.
func lcInStreamError(s stream) *openai.Error {
	if len(s.events) == 0 {
		return nil
	}
	var c chunk
	if json.Unmarshal(s.events[len(s.events)-1], &c) != nil {
		return nil
	}
	return c.Error
}

// lcOutcome classifies what a streaming client got: "ok" (200 and a
// complete stream), "504" (a 504, before or in the stream), "hang" (no
// end before the client's deadline), or a description of anything else.
func lcOutcome(s stream, err error, endpoint openai.Endpoint) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "hang"
	case err != nil:
		return "error: " + err.Error()
	case s.status == http.StatusGatewayTimeout:
		return "504"
	case s.status != http.StatusOK:
		return fmt.Sprintf("status %d: %s", s.status, bytes.Join(s.events, nil))
	}
	if e := lcInStreamError(s); e != nil {
		if e.Code == http.StatusGatewayTimeout {
			return "504"
		}
		return fmt.Sprintf("in-stream error %+v", e)
	}
	if _, err := checkStream(s, endpoint, false); err != nil {
		return "bad stream: " + err.Error()
	}
	return "ok"
}

// lcFirstEvent sends a streaming request and reads its first event. The
// caller owns the returned response and must close it.
func lcFirstEvent(ctx context.Context, url, id string, b any) (*http.Response, []byte, error) {
	resp, err := send(ctx, url, id, b)
	if err != nil {
		return nil, nil, err
	}
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return nil, nil, fmt.Errorf("status %d: %s", resp.StatusCode, raw)
	}
	ev, err := openai.NewSSEReader(resp.Body).Next()
	if err != nil {
		resp.Body.Close()
		return nil, nil, fmt.Errorf("first event: %w", err)
	}
	return resp, ev.Data, nil
}

// lcRawJSON encodes v without HTML escaping: <, > and & stay as they are,
// as most clients other than Go's send them.
func lcRawJSON(t *testing.T, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return bytes.TrimRight(buf.Bytes(), "\n")
}

// lcRequestRecord is the gateway's record of a request, from GET
// /v1/requests/{id} (the fix's API).
type lcRequestRecord struct {
	ID         string `json:"id"`
	State      string `json:"state"`
	Generation int    `json:"generation"`
	Error      *struct {
		Status  int    `json:"status"`
		Message string `json:"message"`
	} `json:"error"`
}

// lcPeakRSS reads a process's peak resident set size (VmHWM) in bytes.
func lcPeakRSS(pid int) (int64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			f := strings.Fields(rest)
			if len(f) != 2 || f[1] != "kB" {
				return 0, fmt.Errorf("VmHWM line %q", line)
			}
			kb, err := strconv.ParseInt(f[0], 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmHWM in /proc/<pid>/status")
}
