package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

const (
	// graceStreamTokens, at the decode engine's 50 ms a token, make a
	// stream of 30 s, far longer than the 1 s shutdown grace of the tests.
	graceStreamTokens = 600
	// cutFirst is how many events a client reads before the shutdown.
	cutFirst = 3
)

// cutStream is what a client read of a stream after the first events.
type cutStream struct {
	chunks  int           // token chunks, before and after the cut
	errs    []int         // indexes, among the events, of in-stream errors
	apiErr  *openai.Error // the last in-stream error
	events  int           // data events before [DONE]
	done    bool          // [DONE] came
	tail    error         // how reading ended: nil for a clean EOF
	afterOK bool          // nothing came after [DONE]
}

// startCutStream sends a streamed completions request of
// graceStreamTokens tokens under id, and reads its first cutFirst events.
// The response is closed when the test ends.
func startCutStream(t *testing.T, url, id string) *openai.SSEReader {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	resp, err := send(ctx, url+openai.Completions.Path(), id,
		completionBody(model, longPrompt, body{"max_tokens": graceStreamTokens, "ignore_eos": true, "stream": true}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, raw)
	}
	r := openai.NewSSEReader(resp.Body)
	for i := range cutFirst {
		if _, err := r.Next(); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	return r
}

// readCut reads the rest of a stream whose first cutFirst events were read
// already.
func readCut(r *openai.SSEReader) cutStream {
	s := cutStream{chunks: cutFirst, events: cutFirst, afterOK: true}
	for {
		ev, err := r.Next()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				s.tail = err // the client's time-out, when the stream hung
			}
			return s
		}
		if s.done {
			s.afterOK = false
			continue
		}
		if ev.IsDone() {
			s.done = true
			continue
		}
		var c chunk
		if err := json.Unmarshal(ev.Data, &c); err != nil {
			s.tail = fmt.Errorf("event %q: %w", ev.Data, err)
			return s
		}
		if c.Error != nil {
			s.errs = append(s.errs, s.events)
			s.apiErr = c.Error
		} else if len(c.Choices) > 0 {
			s.chunks++
		}
		s.events++
	}
}

// check fails the test unless the stream was cut as the docs promise: a
// few tokens, then one in-stream error as the last event, then [DONE],
// then the end of the response.
func (s cutStream) check(t *testing.T) {
	t.Helper()
	if s.tail != nil || !s.done || !s.afterOK || len(s.errs) != 1 || s.errs[0] != s.events-1 {
		t.Fatalf("stream after SIGTERM: %d events (%d chunks), in-stream errors at %v (%+v), [DONE] %v, clean after [DONE] %v, ended with %v; "+
			"want chunks, one in-stream error as the last event, [DONE], then a clean end",
			s.events, s.chunks, s.errs, s.apiErr, s.done, s.afterOK, s.tail)
	}
	if s.chunks >= graceStreamTokens {
		t.Errorf("%d chunks: the stream was not cut", s.chunks)
	}
	if s.apiErr.Message == "" || s.apiErr.Code < 500 {
		t.Errorf("in-stream error %+v, want a server error with a message", s.apiErr)
	}
}

// engineStopped fails the test unless the decode engine's one stream since
// before was aborted: not left to run to its end for nobody.
func engineStopped(t *testing.T, e *simtest.Engine, before sim.Stats) {
	t.Helper()
	after := e.WaitStats(t, 15*time.Second, "the cut decode stopped", func(s sim.Stats) bool { return s.Running == 0 })
	if d := lcDelta(after, before); d.Aborts != 1 || lcFinished(d) != 0 {
		t.Errorf("decode engine %+v: want the stream aborted, not run to its end", d)
	}
}

// TestShutdownGraceCutsDecodeStream checks docs/deploy.md: after SIGTERM,
// running requests may finish for PDQ_SHUTDOWN_GRACE; a stream longer than
// that is cut, and its client gets an in-stream error, then [DONE] and the
// end of the response, not a silent cut and not a hang. The decode worker
// running the stream gets SIGTERM, with a 1 s grace.
func TestShutdownGraceCutsDecodeStream(t *testing.T) {
	c := startCluster(t, clusterOptions{decodeSim: []string{"--itl", "50ms"}, env: []string{"PDQ_SHUTDOWN_GRACE=1s"}})
	c.worker(dispatcher.StagePrefill, 2)
	d := c.worker(dispatcher.StageDecode, 4)
	c.ready()
	before := c.decode.Stats(t)
	r := startCutStream(t, c.url, "grace-decode")
	sigterm(t, d)
	s := readCut(r)
	s.check(t)
	t.Logf("%d chunks, then %+v", s.chunks, s.apiErr)
	if rec := c.record("grace-decode"); rec.State != dispatcher.StateFailed {
		t.Errorf("record %+v, want failed", rec)
	}
	engineStopped(t, c.decode, before)
}
