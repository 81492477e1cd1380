package sched

import (
	"testing"
	"time"
)

// testConfig is a small engine: 16-token blocks, 1 ms a step, 10 µs a
// prefill token, 100 µs a decoding sequence.
func testConfig() Config {
	return Config{BlockSize: 16, NumBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 256,
		PrefixCaching: true, Policy: FCFS,
		Cost: Cost{Base: time.Millisecond, PerPrefillToken: 10 * time.Microsecond, PerDecodeSeq: 100 * time.Microsecond}}
}

func newSched(t *testing.T, mod func(*Config)) *Scheduler {
	t.Helper()
	cfg := testConfig()
	if mod != nil {
		mod(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// prompt is a request whose token ids are from, from+1, ...: prompts that
// start from the same id share their prefix.
func prompt(id string, tokens, from, out int) *Request {
	ids := make([]uint64, tokens/16)
	for i := range ids {
		ids[i] = uint64(from*1000 + i + 1) // a stand-in for a chained hash
	}
	return &Request{ID: id, PromptTokens: tokens, Hashes: ids, MaxTokens: out}
}

func add(t *testing.T, s *Scheduler, rs ...*Request) {
	t.Helper()
	for _, r := range rs {
		if err := s.Add(r); err != nil {
			t.Fatal(err)
		}
	}
}

// step runs one step, reading every load at once, and returns it.
func step(s *Scheduler) (*Plan, []Event) {
	p := s.Schedule()
	for _, r := range p.Loads {
		s.Loaded(r, true)
	}
	return p, s.Complete(p)
}

// until runs steps until r is done, and returns the virtual time taken.
func until(t *testing.T, s *Scheduler, r *Request) time.Duration {
	t.Helper()
	var clock time.Duration
	for i := 0; i < 10000; i++ {
		if r.state == finished || r.state == held {
			return clock
		}
		p, evs := step(s)
		clock += p.Duration
		for _, e := range evs {
			if e.Req == r && e.Done {
				return clock
			}
		}
	}
	t.Fatalf("%s not done after 10000 steps", r.ID)
	return 0
}

func TestChunkedPrefill(t *testing.T) {
	s := newSched(t, nil)
	r := prompt("long", 600, 1, 3)
	add(t, s, r)
	var chunks []int
	var busy time.Duration
	for {
		p, evs := step(s)
		chunks = append(chunks, p.PrefillTokens)
		busy += p.Duration
		if len(evs) > 0 {
			break
		}
	}
	if st := s.Stats(); st.Steps != 3 || st.Busy != busy {
		t.Errorf("stats say %d steps, %v busy; want 3 and the steps' cost, %v", st.Steps, st.Busy, busy)
	}
	want := []int{256, 256, 88}
	if len(chunks) != len(want) || chunks[0] != want[0] || chunks[1] != want[1] || chunks[2] != want[2] {
		t.Errorf("prefill chunks %v, want %v: the prompt in steps of the 256-token budget", chunks, want)
	}
	if r.Generated() != 1 {
		t.Errorf("%d tokens after the prefill, want 1: the last chunk samples the first", r.Generated())
	}
}

func TestStepCost(t *testing.T) {
	cost := testConfig().Cost
	for _, tc := range []struct {
		name            string
		prefill, decode int
		want            time.Duration
	}{
		{"one decode", 0, 1, 1100 * time.Microsecond},
		{"eight decodes: ITL grows with the batch", 0, 8, 1800 * time.Microsecond},
		{"a prefill chunk beside the decodes slows them", 256, 8, 4360 * time.Microsecond},
	} {
		if got := cost.Step(tc.prefill, tc.decode, 0); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestDecodesShareAStepWithAPrefill(t *testing.T) {
	s := newSched(t, nil)
	a := prompt("a", 32, 1, 50)
	add(t, s, a)
	step(s) // a's prefill
	p, _ := step(s)
	alone := p.Duration
	add(t, s, prompt("b", 200, 2, 5))
	p, evs := step(s)
	if p.DecodeSeqs != 1 || p.PrefillTokens != 200 {
		t.Fatalf("step ran %d decodes and %d prefill tokens, want a's decode beside b's 200", p.DecodeSeqs, p.PrefillTokens)
	}
	if p.Duration <= alone {
		t.Errorf("a's token took %v beside a prefill, %v alone: want longer", p.Duration, alone)
	}
	if len(evs) != 2 {
		t.Errorf("%d events, want a token for each", len(evs))
	}
}

func TestMaxNumSeqs(t *testing.T) {
	s := newSched(t, func(c *Config) { c.MaxNumSeqs = 2 })
	a, b, c := prompt("a", 16, 1, 4), prompt("b", 16, 2, 4), prompt("c", 16, 3, 4)
	add(t, s, a, b, c)
	step(s)
	if st := s.Stats(); st.Running != 2 || st.Waiting != 1 {
		t.Fatalf("running %d waiting %d, want 2 and 1", st.Running, st.Waiting)
	}
	until(t, s, a)
	step(s)
	if c.Generated() == 0 {
		t.Errorf("c has no token after a finished: want it admitted to a's seat")
	}
}

func TestKVCapacity(t *testing.T) {
	t.Run("a request waits for blocks", func(t *testing.T) {
		s := newSched(t, func(c *Config) { c.NumBlocks = 10; c.PrefixCaching = false })
		a, b := prompt("a", 128, 1, 2), prompt("b", 64, 2, 2) // 8 and 4 blocks
		add(t, s, a, b)
		step(s)
		if b.Generated() != 0 || s.Stats().Waiting != 1 {
			t.Fatalf("b ran with 2 blocks free, want it waiting")
		}
		until(t, s, a)
		until(t, s, b)
	})
	t.Run("held prefill blocks count until released", func(t *testing.T) {
		s := newSched(t, func(c *Config) { c.NumBlocks = 10; c.PrefixCaching = false })
		p := prompt("p", 128, 1, 1)
		p.Kind = Prefill
		add(t, s, p)
		until(t, s, p)
		if st := s.Stats(); st.UsedBlocks != 8 {
			t.Fatalf("%d blocks used after the prefill, want its 8 held", st.UsedBlocks)
		}
		b := prompt("b", 64, 2, 2)
		add(t, s, b)
		if step(s); b.Generated() != 0 {
			t.Fatal("b ran while the prefill held its blocks")
		}
		s.Release(p)
		until(t, s, b)
		if st := s.Stats(); st.UsedBlocks != 0 {
			t.Errorf("%d blocks used at the end, want 0", st.UsedBlocks)
		}
	})
	t.Run("too long for the cache", func(t *testing.T) {
		s := newSched(t, func(c *Config) { c.NumBlocks = 4 })
		if err := s.Add(prompt("x", 80, 1, 1)); err == nil {
			t.Error("a 5-block prompt was queued on a 4-block engine")
		}
	})
}

func TestPreemption(t *testing.T) {
	for _, tc := range []struct {
		policy Policy
		prio   [3]int
		victim int
	}{
		{FCFS, [3]int{0, 0, 0}, 2},     // the last running
		{Priority, [3]int{0, 5, 1}, 1}, // the highest value
		{Priority, [3]int{1, 0, 1}, 2}, // of equals, the latest
	} {
		t.Run(string(tc.policy), func(t *testing.T) {
			// Three requests of 2 blocks each on 7 blocks: each needs a
			// third block 16 tokens on, and only one is free.
			s := newSched(t, func(c *Config) { c.NumBlocks = 7; c.Policy = tc.policy; c.PrefixCaching = false })
			rs := make([]*Request, 3)
			for i := range rs {
				rs[i] = prompt(string(rune('a'+i)), 32, i+1, 40)
				rs[i].Priority = tc.prio[i]
			}
			add(t, s, rs...)
			var preempted []*Request
			for range 20 {
				p, _ := step(s)
				preempted = append(preempted, p.Preempted...)
				if len(preempted) > 0 {
					break
				}
			}
			if len(preempted) == 0 || preempted[0] != rs[tc.victim] {
				t.Fatalf("preempted %v, want %s", preempted, rs[tc.victim].ID)
			}
			v := rs[tc.victim]
			if v.Blocks() != 0 || v.Preemptions() != 1 {
				t.Errorf("victim holds %d blocks after %d preemptions, want 0 and 1", v.Blocks(), v.Preemptions())
			}
			for _, r := range rs {
				until(t, s, r)
			}
			if got := s.Stats().Preemptions; got < 1 {
				t.Errorf("stats count %d preemptions", got)
			}
		})
	}
}

func TestPriorityOrdersWaiting(t *testing.T) {
	s := newSched(t, func(c *Config) { c.MaxNumSeqs = 1; c.Policy = Priority })
	first := prompt("first", 16, 1, 3)
	add(t, s, first)
	step(s)
	low, high, mid := prompt("low", 16, 2, 1), prompt("high", 16, 3, 1), prompt("mid", 16, 4, 1)
	low.Priority, high.Priority, mid.Priority = 5, -1, 0
	add(t, s, low, high, mid)
	var order []string
	for len(order) < 4 {
		_, evs := step(s)
		for _, e := range evs {
			if e.Done {
				order = append(order, e.Req.ID)
			}
		}
	}
	if got := order[1] + "," + order[2] + "," + order[3]; got != "high,mid,low" {
		t.Errorf("waiting requests ran %s, want high,mid,low (lower priority value first)", got)
	}
}

func TestPrefixCache(t *testing.T) {
	t.Run("a shared prefix is not computed again", func(t *testing.T) {
		s := newSched(t, nil)
		a := prompt("a", 100, 1, 1) // 6 full blocks
		add(t, s, a)
		until(t, s, a)
		b := prompt("b", 100, 1, 1)
		add(t, s, b)
		p, _ := step(s)
		if b.CachedTokens() != 96 || p.PrefillTokens != 4 {
			t.Errorf("cached %d, computed %d: want 96 of 100 cached and 4 computed", b.CachedTokens(), p.PrefillTokens)
		}
		st := s.Stats()
		if st.PrefixQueries != 200 || st.PrefixHits != 96 {
			t.Errorf("queries %d hits %d, want 200 and 96 tokens", st.PrefixQueries, st.PrefixHits)
		}
	})
	t.Run("the last prompt token is computed", func(t *testing.T) {
		s := newSched(t, nil)
		a := prompt("a", 64, 1, 1)
		add(t, s, a)
		until(t, s, a)
		b := prompt("b", 64, 1, 1)
		add(t, s, b)
		p, _ := step(s)
		if b.CachedTokens() != 48 || p.PrefillTokens != 16 {
			t.Errorf("cached %d computed %d of an identical 64-token prompt, want 48 and 16", b.CachedTokens(), p.PrefillTokens)
		}
	})
	t.Run("off", func(t *testing.T) {
		s := newSched(t, func(c *Config) { c.PrefixCaching = false })
		a := prompt("a", 100, 1, 1)
		add(t, s, a)
		until(t, s, a)
		b := prompt("b", 100, 1, 1)
		add(t, s, b)
		if step(s); b.CachedTokens() != 0 {
			t.Errorf("cached %d with prefix caching off", b.CachedTokens())
		}
	})
	t.Run("least recently used is evicted first, a prefix after its tail", func(t *testing.T) {
		s := newSched(t, func(c *Config) { c.NumBlocks = 8 })
		a := prompt("a", 64, 1, 1) // 4 blocks, cached once free
		add(t, s, a)
		until(t, s, a)
		b := prompt("b", 64, 2, 1)
		add(t, s, b)
		until(t, s, b)
		// 8 blocks free, all cached. c takes 2: a's are older, and a's
		// last blocks go before its first.
		c := prompt("c", 32, 3, 1)
		add(t, s, c)
		until(t, s, c)
		if got := s.pool.hits(a.Hashes); got != 2 {
			t.Errorf("%d of a's leading blocks still cached, want 2 (its tail evicted, not its head)", got)
		}
		if got := s.pool.hits(b.Hashes); got != 4 {
			t.Errorf("%d of b's blocks still cached, want 4 (newer than a's)", got)
		}
	})
	t.Run("a cached block in use is shared", func(t *testing.T) {
		s := newSched(t, nil)
		a := prompt("a", 64, 1, 100)
		add(t, s, a)
		step(s)
		step(s)
		b := prompt("b", 64, 1, 100)
		add(t, s, b)
		step(s)
		if b.CachedTokens() != 48 {
			t.Errorf("b cached %d tokens of running a's prompt, want 48", b.CachedTokens())
		}
		if used := s.Stats().UsedBlocks; used != 5+1 {
			t.Errorf("%d blocks used, want a's 5 and b's own 1 (3 shared)", used)
		}
	})
}

func TestRemoteDecode(t *testing.T) {
	t.Run("reads the prompt, computes its last token", func(t *testing.T) {
		s := newSched(t, nil)
		r := prompt("d", 100, 1, 3)
		r.Kind = Decode
		add(t, s, r)
		p := s.Schedule()
		if len(p.Loads) != 1 || !p.Empty() {
			t.Fatalf("plan %+v, want the decode's load and nothing to compute", p)
		}
		if r.ExternalTokens() != 100 || r.Blocks() != 7 {
			t.Errorf("%d external tokens in %d blocks, want 100 in 7", r.ExternalTokens(), r.Blocks())
		}
		if st := s.Stats(); st.Waiting != 1 || st.Running != 0 {
			t.Errorf("a load is waiting (vLLM's WAITING_FOR_REMOTE_KVS): running %d waiting %d", st.Running, st.Waiting)
		}
		s.Loaded(r, true)
		p = s.Schedule()
		evs := s.Complete(p)
		if p.PrefillTokens != 1 || len(evs) != 1 || !evs[0].Token {
			t.Errorf("first step computed %d tokens with events %v, want the last prompt token and a sample", p.PrefillTokens, evs)
		}
		if got := until(t, s, r); got != s.cfg.Cost.Step(0, 1, 100)+s.cfg.Cost.Step(0, 1, 101) {
			t.Errorf("two more tokens took %v", got)
		}
		if s.Stats().UsedBlocks != 0 {
			t.Error("blocks left in use")
		}
	})
	t.Run("a cached prefix is not read", func(t *testing.T) {
		s := newSched(t, nil)
		first := prompt("turn1", 64, 1, 1)
		first.Kind = Decode
		add(t, s, first)
		until(t, s, first)
		next := prompt("turn2", 100, 1, 1)
		next.Kind = Decode
		add(t, s, next)
		s.Schedule()
		if next.LocalHitTokens() != 64 || next.ExternalTokens() != 36 || next.CachedTokens() != 100 {
			t.Errorf("local %d external %d cached %d, want 64, 36, 100", next.LocalHitTokens(), next.ExternalTokens(), next.CachedTokens())
		}
	})
	t.Run("a failed load recomputes", func(t *testing.T) {
		s := newSched(t, nil)
		r := prompt("d", 100, 1, 1)
		r.Kind = Decode
		add(t, s, r)
		p := s.Schedule()
		s.Loaded(p.Loads[0], false)
		p, _ = step(s)
		if p.PrefillTokens != 100 {
			t.Errorf("computed %d tokens after a failed load, want the 100-token prompt", p.PrefillTokens)
		}
	})
}

func TestAbortFreesBlocks(t *testing.T) {
	s := newSched(t, nil)
	a, b := prompt("a", 100, 1, 50), prompt("b", 100, 2, 50)
	b.Kind = Decode
	add(t, s, a, b)
	p := s.Schedule()
	s.Abort(a)
	s.Abort(b)
	if evs := s.Complete(p); len(evs) != 0 {
		t.Errorf("events %v for aborted requests", evs)
	}
	if st := s.Stats(); st.UsedBlocks != 0 || st.Running != 0 || st.Waiting != 0 {
		t.Errorf("%+v after aborting everything, want nothing used", st)
	}
	if s.Busy() {
		t.Error("busy with nothing to do")
	}
}
