package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestBatchPromptFailsMidStream checks docs/api.md (Batched prompts) and
// docs/reliability.md: one prompt of a batched completions request that
// fails after the others have streamed fails the request with an
// in-stream error, then [DONE] and the end of the stream; the other
// prompts are stopped, each recorded cancelled under <id>-<i>, and their
// engine calls aborted.
//
// Prompts 0 and 2 are short and stream at once, decode-only. Prompt 1 is
// long: it waits in prefill on an engine the test holds stopped (SIGSTOP)
// until prompts 0 and 2 have streamed, then the decode engine refuses it
// for length (over --max-model-len, which only an engine can count for a
// text prompt).
func TestBatchPromptFailsMidStream(t *testing.T) {
	prefillP, pe := startSimProcess(t)
	_, de := startSimProcess(t, "--itl", "20ms", "--max-model-len", "512")
	_, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+de.URL)
	before := de.WaitStats(t, 10*time.Second, "warm-up settled", func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 })

	if err := prefillP.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	var resumed sync.Once
	resume := func() {
		resumed.Do(func() {
			if err := prefillP.cmd.Process.Signal(syscall.SIGCONT); err != nil {
				t.Error(err)
			}
		})
	}
	t.Cleanup(resume)

	const id, maxTokens = "batch-fails", 200 // 4 s a prompt at 20 ms a token
	// Prompt 1 is 400 tokens to the engines: 400 + 200 > 512.
	prompts := []any{lcShortPrompt(0), strings.Repeat("word ", 400), lcShortPrompt(2)}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := send(ctx, url+openai.Completions.Path(), id,
		body{"model": model, "prompt": prompts, "max_tokens": maxTokens, "ignore_eos": true, "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, raw)
	}
	r := openai.NewSSEReader(resp.Body)
	chunks := map[int]int{} // choice index -> chunks
	var errs []*openai.Error
	events, done := 0, false
	read := func() error {
		ev, err := r.Next()
		if err != nil {
			return err
		}
		if done {
			return fmt.Errorf("event after [DONE]: %s", ev.Data)
		}
		if ev.IsDone() {
			done = true
			return nil
		}
		events++
		var c chunk
		if err := json.Unmarshal(ev.Data, &c); err != nil {
			return fmt.Errorf("event %q: %w", ev.Data, err)
		}
		if c.Error != nil {
			errs = append(errs, c.Error)
		} else if len(errs) > 0 {
			return fmt.Errorf("event after the in-stream error: %s", ev.Data)
		}
		for _, ch := range c.Choices {
			chunks[ch.Index]++
		}
		return nil
	}
	// Prompts 0 and 2 stream while prompt 1 waits for its prefill.
	for chunks[0] < 3 || chunks[2] < 3 {
		if err := read(); err != nil {
			t.Fatalf("before the failure: %v; chunks %v, errors %+v", err, chunks, errs)
		}
		if len(errs) > 0 || done {
			t.Fatalf("the stream ended before prompts 0 and 2 streamed: chunks %v, errors %+v", chunks, errs)
		}
	}
	resume()
	var end error
	for end == nil {
		end = read()
	}
	if !errors.Is(end, io.EOF) || len(errs) != 1 || !done {
		t.Fatalf("after prompt 1's failure: %d events, chunks %v, in-stream errors %+v, [DONE] %v, ended with %v; "+
			"want one in-stream error as the last event, [DONE], then a clean end", events, chunks, errs, done, end)
	}
	if e := errs[0]; e.Code != http.StatusBadRequest || !strings.Contains(e.Message, "512") {
		t.Errorf("in-stream error %+v, want the decode engine's 400 for prompt 1's length", e)
	}
	if chunks[1] != 0 || chunks[0] >= maxTokens || chunks[2] >= maxTokens {
		t.Errorf("chunks by choice %v: want none of prompt 1, and prompts 0 and 2 cut", chunks)
	}
	t.Logf("chunks by choice %v, then %+v", chunks, errs[0])

	// Each prompt's record holds its end: prompt 1 failed, the others
	// cancelled.
	for i, want := range []dispatcher.State{dispatcher.StateCancelled, dispatcher.StateFailed, dispatcher.StateCancelled} {
		if rec := waitRecordEnded(t, url, fmt.Sprintf("%s-%d", id, i)); rec.State != want {
			t.Errorf("record of prompt %d: %+v, want %s", i, rec, want)
		}
	}
	// No engine works on for prompts 0 and 2: their two calls were aborted,
	// and neither ran to its end.
	after := de.WaitStats(t, 10*time.Second, "the decode engine idle", func(s sim.Stats) bool { return s.Running == 0 && s.Waiting == 0 })
	if d := lcDelta(after, before); d.Aborts != 2 || d.Local != 0 {
		t.Errorf("decode engine %+v: want prompts 0 and 2 aborted, none run to its end", d)
	}
}

// waitRecordEnded polls a request's record until it holds an end, for up
// to 10 s, and returns the last record read.
func waitRecordEnded(t *testing.T, url, id string) dispatcher.Record {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var rec dispatcher.Record
		if r := get(t, url+"/v1/requests/"+id); r.status == http.StatusOK {
			r.decode(t, &rec)
		}
		if rec.State.Ended() || time.Now().After(deadline) {
			return rec
		}
		time.Sleep(20 * time.Millisecond)
	}
}
