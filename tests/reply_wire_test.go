package tests

import (
	"regexp"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
)

// TestReplyWireFramed checks the reply stream on the wire between real
// processes: a gateway and a decode worker of this build pass chunks
// framed, every chunk message without NATS headers, and still end the
// reply with a done message in headers.
func TestReplyWireFramed(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	sub := c.tap(dispatcher.ReplySubject("*", "wire-1"))
	if o := c.one("wire-1", 0, chatBody(model, "hello there", body{"stream": true, "max_tokens": 8})); !o.ok {
		t.Fatalf("the request failed: %+v", o)
	}
	c.flush() // the server sent every reply message here before the flush's answer
	frame := regexp.MustCompile(`^[0-9]+ [0-9]+ [1-9][0-9]*\n`)
	var framed, done int
	for {
		m, err := sub.NextMsg(0)
		if err != nil {
			break
		}
		switch kind := m.Header.Get(dispatcher.HeaderKind); {
		case len(m.Header) == 0 && frame.Match(m.Data):
			framed++
		case kind == dispatcher.KindDone:
			done++
		case kind == dispatcher.KindChunk:
			t.Errorf("a chunk went with headers %v", m.Header)
		case len(m.Header) == 0:
			t.Errorf("a message with neither headers nor a frame: %q", m.Data)
		}
	}
	if framed == 0 || done == 0 {
		t.Errorf("%d framed chunk messages and %d done; want some of each", framed, done)
	}
}

// TestBatchPromptsMarked checks, on the wire, that the gateway marks the
// jobs of a batch's prompts (Pdq-Batch-Prompt), whose acks workers confirm, and
// no other job.
func TestBatchPromptsMarked(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	c.worker(dispatcher.StagePrefill, 4)
	c.worker(dispatcher.StageDecode, 4)
	c.ready()
	jobs := c.tap(dispatcher.JobSubject(dispatcher.StageDecode, "*", "*"))
	if o := c.one("marked-batch", 0, completionBody(model, "", body{"prompt": []string{"one", "two"}, "max_tokens": 2})); o.status != 200 {
		t.Fatalf("the batch failed: %+v", o)
	}
	if o := c.one("marked-single", 0, completionBody(model, "three", body{"max_tokens": 2})); !o.ok {
		t.Fatalf("the request failed: %+v", o)
	}
	c.flush()
	marked := map[string]bool{}
	for {
		m, err := jobs.NextMsg(0)
		if err != nil {
			break
		}
		marked[m.Header.Get(dispatcher.HeaderID)] = m.Header.Get(dispatcher.HeaderBatchPrompt) == "1"
	}
	want := map[string]bool{"marked-batch-0": true, "marked-batch-1": true, "marked-single": false}
	if len(marked) != len(want) {
		t.Fatalf("decode jobs %v, want %v", marked, want)
	}
	for id, w := range want {
		if got, ok := marked[id]; !ok || got != w {
			t.Errorf("job %s marked %v (seen %v), want %v", id, got, ok, w)
		}
	}
}
