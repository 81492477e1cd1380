package tests

import (
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// TestGivenBackDecodeWaitsInQueue runs pdq up with PDQ_FAIR_LIMIT=engines
// (the decode worker beats at once as it takes a job, Job.ReplyStart), a
// stall time-out of 1 s, and two decode engines of one slot each. One
// engine runs a long decode; the other is killed. The request sent then
// goes to the dead engine's worker, which gives it back to the queue
// without output (a handoff is handed back unread; a decode-only job is
// retried) and stops pulling (its breaker opens). The job then waits in
// the queue for the busy worker, longer than the stall time-out: a queue's
// wait, not a silent decode. The client must get its whole answer, once.
func TestGivenBackDecodeWaitsInQueue(t *testing.T) {
	for _, tc := range []struct {
		name, prompt string
		// given is what the worker logs as it gives the job back.
		given string
	}{
		{"a handoff handed back", longPrompt, "job handed back"},
		{"a decode-only job retried", "Hello!", "job failed; retrying"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, pe := startSimProcess(t)
			p1, d1 := startSimProcess(t, "--itl", "20ms")
			p2, d2 := startSimProcess(t, "--itl", "20ms")
			up, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+d1.URL+","+d2.URL,
				"PDQ_FAIR_LIMIT=engines", "PDQ_STALL_TIMEOUT=1s", "PDQ_ENGINE_SLOTS=1")

			// A long decode (250 tokens, 5 s) holds one decode worker's
			// only slot.
			var wg sync.WaitGroup
			defer wg.Wait()
			wg.Go(func() {
				r, err := tryPost(url+"/v1/completions", "giveback-long",
					completionBody(model, longPrompt, body{"max_tokens": 250, "ignore_eos": true}))
				if err != nil || r.status != http.StatusOK {
					t.Errorf("the long request: %d %s, %v; want 200", r.status, r.body, err)
				}
			})
			running := func(e *simtest.Engine) bool { return e.Stats(t).Running > 0 }
			deadline := time.Now().Add(10 * time.Second)
			for !running(d1) && !running(d2) {
				if time.Now().After(deadline) {
					t.Fatal("the long decode did not start within 10 s")
				}
				time.Sleep(10 * time.Millisecond)
			}
			// The other engine dies: its worker, idle, takes the next job.
			idle := p1
			if running(d1) {
				idle = p2
			}
			kill9(t, idle)

			const id = "giveback-one"
			s := postStream(t, url+"/v1/completions", id,
				completionBody(model, tc.prompt, body{"max_tokens": 8, "ignore_eos": true, "stream": true}))
			res, err := checkStream(s, openai.Completions, false)
			switch {
			case err != nil:
				t.Errorf("want the whole stream: %v", err)
			case res.finish != "length":
				t.Errorf("finish_reason %q, want length: the whole answer of 8 tokens", res.finish)
			}
			var rec dispatcher.Record
			get(t, url+"/v1/requests/"+id).decode(t, &rec)
			if rec.State != dispatcher.StateDone {
				t.Errorf("record %+v, want done", rec)
			}
			// The scenario happened: the dead engine's worker gave the job
			// back before another took it.
			if !logged(up, tc.given, id) {
				t.Errorf("pdq up did not log %q for %s: the job did not go to the dead engine's worker first", tc.given, id)
			}
			live := d1
			if idle == p1 {
				live = d2
			}
			if n := len(rec.Stages); n == 0 || rec.Stages[n-1].Engine != live.URL {
				t.Errorf("record's stages %+v, want the last one on the live decode engine %s", rec.Stages, live.URL)
			}
		})
	}
}

// logged reports whether p logged msg for request id.
func logged(p *process, msg, id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.recs {
		if r["msg"] == msg && r["request_id"] == id {
			return true
		}
	}
	return false
}
