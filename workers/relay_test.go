package workers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

func TestWholeAnswerLimit(t *testing.T) {
	const stall = 30 * time.Second
	for _, tc := range []struct {
		endpoint openai.Endpoint
		body     string
		want     time.Duration
	}{
		{openai.Completions, `{"prompt":"x","max_tokens":2000,"max_completion_tokens":0}`, stall + 100*time.Second},
		{openai.Completions, `{"prompt":"x"}`, stall + 800*time.Millisecond},
		{openai.Completions, `{"prompt":"x","max_tokens":null}`, 24 * time.Hour},
		{openai.Chat, `{"messages":[],"max_tokens":10,"max_completion_tokens":20}`, stall + time.Second},
		{openai.Chat, `{"messages":[]}`, 24 * time.Hour},
	} {
		if got := wholeAnswerLimit(tc.endpoint, []byte(tc.body), stall); got != tc.want {
			t.Errorf("%s %s: %v, want %v", tc.endpoint, tc.body, got, tc.want)
		}
	}
}

// TestRelayStreamBatch: with batching on, every event reaches the reply as
// soon as the engine stops sending, whatever follows it in the stream
// (a comment, a block without data, half an event); a chunk with a newline
// goes alone; [DONE] ends it.
func TestRelayStreamBatch(t *testing.T) {
	nc := embeddedtest.Conn(t, logging.Discard())
	for i, tc := range []struct {
		name, first, rest string
		want              int // chunks out once first is written
		msgs              int // NATS messages they went in
	}{
		{"two at once", "data: a\n\ndata: b\n\n", "", 2, 1},
		{"a comment after", "data: a\n\n: ping\n\n", "", 1, 1},
		{"a block without data after", "data: a\n\nevent: x\n\n", "", 1, 1},
		{"half an event after", "data: a\n\ndata: b", "\n\n", 1, 1},
		{"lines joined by a newline", "data: a\ndata: b\n\ndata: c\n\n", "", 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			subject := "test.relay." + strconv.Itoa(i)
			sub, err := nc.SubscribeSync(subject)
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			pr, pw := io.Pipe()
			out := reply.NewWriter(nc, subject, 1)
			done := make(chan error, 1)
			hooks := eventHooks{each: func(d []byte) []byte { return d }, sent: func([]byte) {}}
			go func() { done <- relayStream(context.Background(), pr, out, hooks, true) }()
			go pw.Write([]byte(tc.first))
			deadline := time.Now().Add(5 * time.Second)
			for out.Sent() < tc.want && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if got := out.Sent(); got != tc.want {
				t.Fatalf("%d chunks out while the engine waits, want %d", got, tc.want)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			if n, _, _ := sub.Pending(); n != tc.msgs {
				t.Errorf("the chunks went out in %d messages, want %d", n, tc.msgs)
			}
			go func() {
				pw.Write([]byte(tc.rest + "data: [DONE]\n\n"))
				pw.Close()
			}()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			kept, _ := out.Kept()
			if tc.name == "lines joined by a newline" && (len(kept) != 2 || string(kept[0]) != "a\nb") {
				t.Errorf("chunks %q", kept)
			}
		})
	}
}

// TestEngineFailure checks how an engine's non-2xx answer is taken, as
// docs/api.md and docs/reliability.md promise: 429 and 5xx are retried
// (503 and 5xx count against the engine's health, 429 does not); 401, 403
// and 404 mean a worker set up wrong, retried on prefill and ending a
// decode at once with a 502; any other 4xx is the client's, passed on
// with the engine's status and message.
func TestEngineFailure(t *testing.T) {
	refusal := []byte(`{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}`)
	for _, tc := range []struct {
		stage     dispatcher.Stage
		status    int
		permanent bool
		fault     bool // counts against the engine
		client    int  // the status the client would get
	}{
		{dispatcher.StagePrefill, 429, false, false, 503},
		{dispatcher.StagePrefill, 503, false, true, 503},
		{dispatcher.StagePrefill, 500, false, true, 502},
		{dispatcher.StagePrefill, 401, false, false, 502},
		{dispatcher.StagePrefill, 404, false, false, 502},
		{dispatcher.StagePrefill, 400, true, false, 400},
		{dispatcher.StageDecode, 429, false, false, 503},
		{dispatcher.StageDecode, 502, false, true, 502},
		{dispatcher.StageDecode, 403, true, false, 502},
		{dispatcher.StageDecode, 404, true, false, 502},
		{dispatcher.StageDecode, 400, true, false, 400},
	} {
		t.Run(fmt.Sprintf("%s %d", tc.stage, tc.status), func(t *testing.T) {
			err := engineFailure(tc.stage, tc.status, refusal, 0)
			var f *verdict.Failure
			if !errors.As(err, &f) {
				t.Fatalf("%v is not a verdict.Failure", err)
			}
			var fault *engineFault
			if f.Permanent != tc.permanent || errors.As(err, &fault) != tc.fault || f.Client == nil || f.Client.Status() != tc.client {
				t.Errorf("%+v (engine fault %v, client %+v), want permanent %v, fault %v, client status %d",
					f, errors.As(err, &fault), f.Client, tc.permanent, tc.fault, tc.client)
			}
		})
	}
}

// TestDecodeFailureReleases checks which failed decode calls count as
// never run, so that their handoff's KV is released (docs/reliability.md):
// those the engine surely did not run. A call answered whole with a 5xx
// may have read the blocks, and is left to the lease: a second read could
// be of blocks the prefill engine has freed and reused, which the decode
// engine would cache as this prompt's.
func TestDecodeFailureReleases(t *testing.T) {
	fail := func(status int, wait time.Duration) error {
		return engineFailure(dispatcher.StageDecode, status, nil, wait)
	}
	refused := unreachable(context.Background(), dispatcher.StageDecode, &notRun{err: errors.New("connection refused")})
	cut := timedOut(dispatcher.StageDecode, "no answer", time.Second)
	for _, tc := range []struct {
		name     string
		err      error
		streamed bool
		release  bool
	}{
		{"refused", refused, false, true},
		{"streamed 500", fail(500, 0), true, true},
		{"streamed 503", fail(503, 0), true, true},
		{"whole 500", fail(500, 0), false, false},
		{"whole 502", fail(502, 0), false, false},
		{"whole 503", fail(503, 0), false, false},
		{"whole 503 with Retry-After", fail(503, time.Second), false, true},
		{"whole call cut off", cut, false, false},
		{"streamed call cut off", cut, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := neverRan(tc.err, tc.streamed); got != tc.release {
				t.Errorf("never ran %v, want %v (%v)", got, tc.release, tc.err)
			}
		})
	}
}
