package tests

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/admin"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// TestReplayDeadline replays a dead letter onto a decode engine that hangs:
// the replay has no client to give up on it, and a non-streamed decode
// without max_tokens has no other bound, so only the request's fresh
// deadline can stop the engine's work and end the record.
func TestReplayDeadline(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	decode := p.decode[0]
	setFault(t, decode, `{"rate":1,"kind":"500"}`)
	r := post(t, p.completions(), "replay-deadline", completionBody(model, longPrompt, body{}))
	r.wantStatus(t, http.StatusBadGateway)

	setFault(t, decode, `{"rate":1,"kind":"hang"}`)
	ctx := context.Background()
	rp, err := admin.NewReplayer(ctx, p.js, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	dl, err := rp.Find(ctx, "replay-deadline")
	if err != nil {
		t.Fatal(err)
	}
	before := decode.Stats(t)
	if _, err := rp.Replay(ctx, dl); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rec, err := rp.Wait(wctx, "replay-deadline")
	if err != nil || rec.State != dispatcher.StateExpired {
		t.Fatalf("replayed record %+v (%v), want expired at its 1 s deadline", rec, err)
	}
	// The hung decode call was aborted, not left running for nobody.
	decode.WaitStats(t, 5*time.Second, "the hung decode aborted", func(s sim.Stats) bool { return s.Aborts > before.Aborts })
}

// lostCancelCluster is a cluster whose gateway may not publish cancels:
// every cancel broadcast is lost, as in a reconnect or a route flap, while
// the gateway still records each request's end.
func lostCancelCluster(t *testing.T, o clusterOptions) *cluster {
	t.Helper()
	url := startAuthServer(t, func(so *server.Options) {
		so.Users = []*server.User{
			{Username: "pdq", Password: "pdq"},
			{Username: "gw", Password: "gw", Permissions: &server.Permissions{
				Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{dispatcher.CancelSubject(">")}},
			}},
		}
	})
	o.env = append([]string{"PDQ_NATS_USER=pdq", "PDQ_NATS_PASSWORD=pdq"}, o.env...)
	o.gatewayEnv = append([]string{"PDQ_NATS_USER=gw", "PDQ_NATS_PASSWORD=gw"}, o.gatewayEnv...)
	return startClusterOn(t, url, o, nats.UserInfo("pdq", "pdq"))
}

// TestRetryAfterLostCancel: a client leaves mid-stream, its cancel is
// lost, and it retries the same id at the same gateway while the first
// decode still streams. The retry's answer must be its own: no chunk of
// the first attempt, and no in-stream 502 when its own chunks come.
func TestRetryAfterLostCancel(t *testing.T) {
	c := lostCancelCluster(t, clusterOptions{
		env:        []string{"PDQ_STALL_TIMEOUT=10s"},        // beats every 2 s: the first decode outlives the retry's start
		prefillSim: []string{"--prefill-overhead", "2500ms"}, // the first decode beats while the retry prefills
		decodeSim:  []string{"--itl", "20ms"},
	})
	c.worker(dispatcher.StagePrefill, 2)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	first := completionBody(model, longPrompt, body{"max_tokens": 400, "ignore_eos": true, "stream": true})
	ctx, cancel := context.WithCancel(context.Background())
	resp, _, err := lcFirstEvent(ctx, c.url+"/v1/completions", "retry-lost", first)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	waitUntil(t, "the first attempt recorded cancelled", func() bool {
		return c.record("retry-lost").State == dispatcher.StateCancelled
	})
	retry := completionBody(model, longPrompt, body{"max_tokens": 5, "ignore_eos": true, "stream": true, "stream_options": body{"include_usage": true}})
	s := postStream(t, c.url+"/v1/completions", "retry-lost", retry)
	res, err := checkStream(s, openai.Completions, true)
	if err != nil {
		t.Fatalf("the retry's answer: %v", err)
	}
	if res.usage.CompletionTokens != 5 || len(s.events) != 6 {
		t.Errorf("the retry got %d events, usage %+v: want its own 5 tokens and the usage chunk", len(s.events), res.usage)
	}
}

// TestBatchOwnsItsID checks that a batched completions request is one
// request under its X-Request-Id, like any other: after batch X has been
// answered, a single request X is a 409, as is a batch X while a single
// request X runs; and GET /v1/requests/X shows the batch.
func TestBatchOwnsItsID(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	batch := body{"model": model, "prompt": []any{"one", "two"}, "max_tokens": 3, "ignore_eos": true}
	post(t, p.completions(), "batch-x", batch).wantStatus(t, http.StatusOK)
	single := completionBody(model, "three", body{"max_tokens": 3})
	if r := post(t, p.completions(), "batch-x", single); r.status != http.StatusConflict {
		t.Errorf("a single request under an answered batch's id: %d %s, want 409", r.status, r.body)
	}
	var rec dispatcher.Record
	get(t, p.url+"/v1/requests/batch-x").decode(t, &rec)
	if rec.State != dispatcher.StateDone || rec.Prompts != 2 {
		t.Errorf("the batch's record %+v, want done with its 2 prompts", rec)
	}

	// A single request X runs (its decode slow): a batch X is refused.
	setFault(t, p.decode[0], `{"rate":1,"kind":"slow","delay":"1s"}`)
	done := make(chan response, 1)
	go func() {
		r, _ := tryPost(p.completions(), "single-y", single)
		done <- r
	}()
	waitUntil(t, "single-y queued", func() bool {
		r, err := tryDo(http.MethodGet, p.url+"/v1/requests/single-y", nil, nil)
		return err == nil && r.status == http.StatusOK
	})
	if r := post(t, p.completions(), "single-y", batch); r.status != http.StatusConflict {
		t.Errorf("a batch under a running request's id: %d %s, want 409", r.status, r.body)
	}
	if r := <-done; r.status != http.StatusOK {
		t.Errorf("the single request: %d %s", r.status, r.body)
	}
}

// TestStalledBodyTimedOut: a client that declares a large body and stops
// sending it must not hold a connection and its reserved bytes for ever;
// the gateway answers 408 once the body's read time is over.
func TestStalledBodyTimedOut(t *testing.T) {
	// A budget of 10 MiB: the stalled body's 7 MB reserved, another of 6
	// MiB fits only once they are given back.
	p := startPipeline(t, pipelineOptions{gateway: gateway.Config{BodyTimeout: 500 * time.Millisecond, MaxInflightBytes: 10 << 20}})
	conn, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: pdq\r\nContent-Type: application/json\r\nContent-Length: 7000000\r\n\r\n")
	fmt.Fprintf(conn, `{"model":"%s","prompt":"%s`, model, strings.Repeat("x", 1000))
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer to a stalled body within 5 s: %v", err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Errorf("a stalled body: %d %s, want 408", resp.StatusCode, raw)
	}
	// The connection is closed: the client cannot go on sending its body.
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("after the 408 the connection reads %v, want it closed (EOF)", err)
	}
	// The bytes it had reserved are back: the largest body fits the
	// gateway's budget again.
	r := post(t, p.completions(), "", completionBody(model, strings.Repeat("x", 6<<20), body{"max_tokens": 1}))
	if r.status == http.StatusTooManyRequests {
		t.Errorf("a 6 MiB body after the stalled one: 429, the budget still held: %s", r.body)
	}
}

// TestAnswerLargerThanAMessage: a non-streamed answer larger than a NATS
// message (8 MiB) reaches its client whole, from one engine call; before,
// NATS refused it, and the decode ran again three times, then failed.
func TestAnswerLargerThanAMessage(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.MaxModelLen, cfg.ITL = 4_000_000, 0
	p := startPipeline(t, pipelineOptions{sim: cfg})
	const tokens = 1_600_000 // some 10 MB of text
	r := post(t, p.completions(), "", completionBody(model, "Hi", body{"max_tokens": tokens, "ignore_eos": true}))
	res, _ := parseResponse(t, r)
	if res.usage.CompletionTokens != tokens || len(r.body) < 8<<20 {
		t.Errorf("answer of %d bytes, usage %+v: want %d tokens, over 8 MiB", len(r.body), res.usage, tokens)
	}
	if s := p.decode[0].Stats(t); s.Requests != 1 {
		t.Errorf("the decode engine got %d requests, want 1", s.Requests)
	}
}

// TestClientLeavesWhileDecodeWaits: a client leaves while its handoff
// waits for a decode engine that answers 503: the engine never ran the
// decode, so the prefill's KV is released, not left to its lease (found
// by review).
func TestClientLeavesWhileDecodeWaits(t *testing.T) {
	cfg := simtest.FastConfig()
	cfg.KVLease = time.Minute
	p := startPipeline(t, pipelineOptions{sim: cfg})
	setFault(t, p.decode[0], `{"rate":1,"kind":"503"}`)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// The client leaves once its decode has met the engine's 503.
		p.decode[0].Poll(10*time.Second, func(s sim.Stats) bool { return s.Faults >= 1 })
		cancel()
	}()
	if _, err := send(ctx, p.completions(), "leave-waiting", completionBody(model, longPrompt, body{"max_tokens": 8, "stream": true})); err == nil {
		t.Fatal("the request was answered while its decode engine answered 503")
	}
	p.prefill[0].WaitStats(t, 5*time.Second, "the prompt prefilled", func(s sim.Stats) bool { return s.Prefills == 1 })
	setFault(t, p.decode[0], `{"rate":0}`)
	if s, err := p.prefill[0].Poll(10*time.Second, func(s sim.Stats) bool { return s.BlocksHeld == 0 }); err != nil {
		t.Errorf("prefill engine %+v: the blocks of a decode never run are still held: %v", s, err)
	}
}
