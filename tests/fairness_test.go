package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestFairQueue runs pdq up with one prefill and one decode engine, and
// floods it from one tenant: another tenant's request, and a request of a
// better priority, go in ahead of the flood, and a tenant over its share
// of the queue is refused before the other tenant is. With
// PDQ_FAIR_LIMIT=engines the flood waits in the gateway, not in the
// workers or the engines, whatever slots the workers have: a request
// holds its turn only until its decode starts.
func TestFairQueue(t *testing.T) {
	type result struct {
		name   string
		status int
		retry  string
		at     time.Time
	}
	// oneSeat gives each worker one engine slot: the pool runs two
	// requests at once, one a stage.
	oneSeat := []string{"PDQ_ENGINE_SLOTS=1"}
	var url string // of the last run's pdq
	run := func(t *testing.T, env []string, flood int, floodBody body, late string, lateBody body) map[string]result {
		t.Helper()
		_, pe := startSimProcess(t, "--scheduling-policy", "priority", "--max-num-seqs", "1", "--prefill-overhead", "100ms")
		_, de := startSimProcess(t, "--scheduling-policy", "priority", "--itl", "10ms")
		_, url = startUp(t, append([]string{"PDQ_PREFILL_ENGINES=" + pe.URL, "PDQ_DECODE_ENGINES=" + de.URL}, env...)...)
		var mu sync.Mutex
		out := map[string]result{}
		var wg sync.WaitGroup
		send := func(name string, b body) {
			r, err := tryPost(url+"/v1/completions", name, b)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("%s: %v", name, err)
				return
			}
			out[name] = result{name: name, status: r.status, retry: r.header.Get("Retry-After"), at: time.Now()}
		}
		for i := range flood {
			wg.Go(func() { send(fmt.Sprintf("flood-%d", i), floodBody) })
		}
		time.Sleep(300 * time.Millisecond) // the flood is in: a few run, the rest wait
		wg.Go(func() { send(late, lateBody) })
		wg.Wait()
		return out
	}
	// rank is where name finished among the requests that were answered.
	rank := func(out map[string]result, name string) int {
		var ok []result
		for _, r := range out {
			if r.status == http.StatusOK {
				ok = append(ok, r)
			}
		}
		sort.Slice(ok, func(i, j int) bool { return ok[i].at.Before(ok[j].at) })
		for i, r := range ok {
			if r.name == name {
				return i + 1
			}
		}
		return -1
	}
	req := func(extra body) body {
		b := completionBody(model, longPrompt, body{"max_tokens": 20, "ignore_eos": true})
		for k, v := range extra {
			b[k] = v
		}
		return b
	}

	t.Run("another tenant goes in ahead of a flood", func(t *testing.T) {
		out := run(t, oneSeat, 12, req(body{"user": "big"}), "small", req(body{"user": "small"}))
		if r := rank(out, "small"); r < 1 || r > 4 {
			t.Errorf("the small tenant's request finished %d of %d; want within the first 4 (it waited for at most two turns)", r, len(out))
		}
	})
	t.Run("with the workers' default slots too, by engines", func(t *testing.T) {
		// The workers would take the flood (8 prefill slots), to queue
		// it in the engine, first come first served, behind one prefill
		// at a time; PDQ_FAIR_LIMIT=engines holds it in the gateway.
		// Decodes run side by side here: the flood's first prefills
		// finish before the small request's.
		// The flood holds every turn: the other tenant's request goes
		// decode-only (the bypass), as a better priority does.
		out := run(t, []string{"PDQ_FAIR_LIMIT=engines"}, 12, req(body{"user": "big"}), "small", req(body{"user": "small", "stream": true}))
		if r := rank(out, "small"); r < 1 || r > 6 {
			t.Errorf("the small tenant's request finished %d of %d; want within the first 6", r, len(out))
		}
		wantPrefilled(t, url, map[string]bool{"small": false, "flood-0": true, "flood-11": true})
	})
	t.Run("a better priority goes in ahead", func(t *testing.T) {
		out := run(t, oneSeat, 12, req(body{"user": "big", "priority": 1}), "urgent", req(body{"user": "big", "priority": 0}))
		if r := rank(out, "urgent"); r < 1 || r > 4 {
			t.Errorf("the priority 0 request finished %d of %d; want within the first 4", r, len(out))
		}
	})
	t.Run("by engines, a better priority skips the prefill queue", func(t *testing.T) {
		// Every prefill engine is taken by the flood: the request that
		// outranks it goes decode-only, its prompt computed by the decode
		// engine, rather than wait for the prefill engine's next seat.
		// Its decode starts before the prefill engine's next seat is
		// done: before any prefill that started after it came has ended
		// (by the records, a prefill's 100 ms of margin: no finishing
		// order, which a loaded machine shuffles).
		out := run(t, []string{"PDQ_FAIR_LIMIT=engines"}, 12, req(body{"user": "big", "priority": 1}), "urgent", req(body{"user": "big", "priority": 0, "stream": true}))
		wantPrefilled(t, url, map[string]bool{"urgent": false, "flood-0": true})
		urgent := record(t, url, "urgent")
		i := slices.IndexFunc(urgent.Stages, func(s dispatcher.StageRecord) bool { return s.Stage == dispatcher.StageDecode })
		if i < 0 {
			t.Fatalf("urgent's record has no decode: %+v", urgent.Stages)
		}
		decoded := urgent.Stages[i].Started
		for name := range out {
			for _, s := range record(t, url, name).Stages {
				if s.Stage == dispatcher.StagePrefill && !s.Started.Before(urgent.Created) && !decoded.Before(s.Ended()) {
					t.Errorf("urgent's decode started %v after %s's prefill, begun after urgent came, ended: it waited for a prefill seat",
						decoded.Sub(s.Ended()), name)
				}
			}
		}
	})
	t.Run("the flooding tenant is refused first", func(t *testing.T) {
		out := run(t, append(oneSeat, "PDQ_MAX_QUEUE=4"), 12, req(body{"user": "big"}), "small", req(body{"user": "small"}))
		refused := 0
		for _, r := range out {
			if r.status == http.StatusTooManyRequests {
				refused++
				if r.retry == "" {
					t.Errorf("%s: 429 without Retry-After", r.name)
				}
			}
		}
		if refused == 0 {
			t.Errorf("no request of the flood refused with a queue of 4: %+v", out)
		}
		if out["small"].status != http.StatusOK {
			t.Errorf("the other tenant's request: %d, want 200 while the flood is refused", out["small"].status)
		}
	})
}

// TestTurnEndsWithThePrefill runs pdq up with PDQ_FAIR_LIMIT=engines, one
// prefill engine and one decode slot: a request whose decode waits for
// that slot does not keep the next request out of the queue. Its turn
// ends as its prefill ends (its prefill worker tells the gateway), not
// once its decode starts, here after the long decode before it.
func TestTurnEndsWithThePrefill(t *testing.T) {
	_, pe := startSimProcess(t, "--max-num-seqs", "1", "--prefill-overhead", "50ms")
	_, de := startSimProcess(t, "--itl", "20ms")
	_, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+de.URL, "PDQ_FAIR_LIMIT=engines", "PDQ_ENGINE_SLOTS=1")
	req := func(tokens int) body {
		return completionBody(model, longPrompt, body{"max_tokens": tokens, "ignore_eos": true})
	}
	var wg sync.WaitGroup
	post := func(id string, b body) {
		wg.Go(func() {
			if r, err := tryPost(url+"/v1/completions", id, b); err != nil || r.status != http.StatusOK {
				t.Errorf("%s: %d, %v", id, r.status, err)
			}
		})
	}
	post("turn-long", req(150)) // 3 s of decode, in the only decode slot
	de.WaitStats(t, 10*time.Second, "the long request decoding", func(s sim.Stats) bool { return s.Running > 0 })
	post("turn-next", req(5)) // prefilled, then waits for the decode slot
	time.Sleep(10 * time.Millisecond)
	post("turn-last", req(5)) // goes in once the one before it prefilled
	wg.Wait()
	next, last := record(t, url, "turn-next"), record(t, url, "turn-last")
	i := slices.IndexFunc(next.Stages, func(s dispatcher.StageRecord) bool { return s.Stage == dispatcher.StageDecode })
	if i < 0 {
		t.Fatalf("turn-next's record has no decode: %+v", next.Stages)
	}
	if decoded := next.Stages[i].Started; !last.Created.Before(decoded) {
		t.Errorf("turn-last went into the queue %v after turn-next's decode started: its turn waited for that decode, not for the prefill",
			last.Created.Sub(decoded))
	}
}

// TestAlikeLoad runs pdq up with PDQ_FAIR_LIMIT=engines and one prefill
// engine, and sends two prompts of about 1,500 tokens at once: only one
// fits the engine's load (config.FairLoad, 2,048 tokens), but two of one
// tenant and one priority go in together (fair.Limit.AlikeLoad) and run
// side by side in the engine, while two of two tenants run one after the
// other, by their records.
func TestAlikeLoad(t *testing.T) {
	prompt := strings.Repeat("Tell me about the KV cache. ", 220) // 6,160 bytes: 1,540 tokens estimated
	for _, tc := range []struct {
		name     string
		tenants  [2]string
		together bool
	}{
		{"one tenant", [2]string{"a", "a"}, true},
		{"two tenants", [2]string{"a", "b"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, pe := startSimProcess(t, "--prefill-overhead", "300ms", "--max-model-len", "16384")
			_, de := startSimProcess(t, "--max-model-len", "16384")
			_, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+de.URL, "PDQ_FAIR_LIMIT=engines")
			var wg sync.WaitGroup
			for i, tenant := range tc.tenants {
				id := fmt.Sprintf("alike-%d", i)
				wg.Go(func() {
					// Not streamed: no bypass, both go through prefill.
					// Prompts of their own: none counts as cached.
					r, err := tryPost(url+"/v1/completions", id, completionBody(model, id+" "+prompt, body{"max_tokens": 2, "user": tenant}))
					if err != nil || r.status != http.StatusOK {
						t.Errorf("%s: %d, %v", id, r.status, err)
					}
				})
			}
			wg.Wait()
			var prefills []dispatcher.StageRecord
			for i := range 2 {
				rec := record(t, url, fmt.Sprintf("alike-%d", i))
				for _, s := range rec.Stages {
					if s.Stage == dispatcher.StagePrefill {
						prefills = append(prefills, s)
					}
				}
			}
			if len(prefills) != 2 {
				t.Fatalf("%d prefills, want 2: %+v", len(prefills), prefills)
			}
			slices.SortFunc(prefills, func(a, b dispatcher.StageRecord) int { return a.Started.Compare(b.Started) })
			// Half the engine's 300 ms: neither an early prefilled
			// message (20 ms) nor a slow start blurs it.
			if together := prefills[1].Started.Sub(prefills[0].Started) < 150*time.Millisecond; together != tc.together {
				t.Errorf("the second prefill began within 150 ms of the first: %v, want %v (%+v)", together, tc.together, prefills)
			}
		})
	}
}

// record reads request id's record from pdq at url.
func record(t *testing.T, url, id string) dispatcher.Record {
	t.Helper()
	r := do(t, http.MethodGet, url+"/v1/requests/"+id, nil, nil)
	var rec dispatcher.Record
	if err := json.Unmarshal(r.body, &rec); err != nil {
		t.Fatalf("record of %s: %v (%s)", id, err, r.body)
	}
	return rec
}

// wantPrefilled checks, by their records, which requests went through a
// prefill engine (true) and which went decode-only.
func wantPrefilled(t *testing.T, url string, want map[string]bool) {
	t.Helper()
	for id, w := range want {
		rec := record(t, url, id)
		if got := slices.ContainsFunc(rec.Stages, func(s dispatcher.StageRecord) bool { return s.Stage == dispatcher.StagePrefill }); got != w {
			t.Errorf("%s went through prefill: %v, want %v (stages %+v)", id, got, w, rec.Stages)
		}
	}
}

// TestBypassFreesAtFirstToken runs pdq up with PDQ_FAIR_LIMIT=engines, one
// prefill engine taken by a flood of priority 1, and one decode engine
// (one bypass at a time): a streamed request of priority 0 goes
// decode-only, and a second one, sent while the first still decodes its
// 200 tokens, goes decode-only too, once the first's first token freed the
// bypass. A non-streamed request of priority 0 waits its turn: its first
// write is its last (a reviewer's finding: it held the bypass for its
// whole answer).
func TestBypassFreesAtFirstToken(t *testing.T) {
	_, pe := startSimProcess(t, "--scheduling-policy", "priority", "--max-num-seqs", "1", "--prefill-overhead", "100ms")
	_, de := startSimProcess(t, "--scheduling-policy", "priority", "--itl", "10ms")
	_, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+de.URL, "PDQ_FAIR_LIMIT=engines")
	var wg sync.WaitGroup
	send := func(id string, b body) {
		wg.Go(func() {
			if r, err := tryPost(url+"/v1/completions", id, b); err != nil || r.status != http.StatusOK {
				t.Errorf("%s: %d, %v", id, r.status, err)
			}
		})
	}
	req := func(tokens int, extra body) body {
		b := completionBody(model, longPrompt, body{"max_tokens": tokens, "ignore_eos": true, "user": "big"})
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	for i := range 12 {
		send(fmt.Sprintf("flood-%d", i), req(20, body{"priority": 1}))
	}
	time.Sleep(300 * time.Millisecond) // the flood holds the prefill engine, the rest waits
	send("first", req(200, body{"priority": 0, "stream": true}))
	time.Sleep(150 * time.Millisecond) // its first token is out; its decode runs 2 s more
	send("second", req(20, body{"priority": 0, "stream": true}))
	time.Sleep(50 * time.Millisecond) // after it: a waiting request as good would go first
	send("whole", req(20, body{"priority": 0}))
	wg.Wait()
	wantPrefilled(t, url, map[string]bool{"first": false, "second": false, "whole": true})
}
