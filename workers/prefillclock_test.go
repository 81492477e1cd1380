package workers

import (
	"testing"
	"time"
)

func TestPrefillClock(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		name string
		// run drives the clock from time 0 (at(d) is that time d in) and
		// returns the expectation to check.
		run  func(c *prefillClock, at func(time.Duration) time.Time) time.Duration
		want time.Duration
	}{
		{"nothing predicted before it learned", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			for i := range clockSamples - 1 {
				c.end(c.begin(1000, at(time.Duration(i)*time.Second)), at(time.Duration(i)*time.Second+100*ms), true, cached(0))
			}
			return c.begin(1000, at(10*time.Second)).expect
		}, 0},
		{"a prefill alone: its tokens at the learned rate", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			learn(c, at, 1000, 100*ms)
			return c.begin(2000, at(time.Hour)).expect
		}, 200 * ms},
		{"one begun behind another ends after it", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			learn(c, at, 1000, 100*ms)
			c.begin(1000, at(time.Hour)) // ends 100 ms in
			return c.begin(500, at(time.Hour+80*ms)).expect
		}, 70 * ms},
		{"behind one whose end is not known: not known", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			learn(c, at, 1000, 100*ms)
			c.begin(0, at(time.Hour)) // its tokens not known
			return c.begin(1000, at(time.Hour)).expect
		}, 0},
		{"cached prompts, failures and prefills behind two teach nothing", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			learn(c, at, 1000, 100*ms)
			h := time.Hour
			c.end(c.begin(1000, at(h)), at(h+10*ms), true, cached(900))
			c.end(c.begin(1000, at(2*h)), at(2*h+ms), false, cached(0))
			a, b, x := c.begin(1000, at(3*h)), c.begin(1000, at(3*h+ms)), c.begin(1000, at(3*h+2*ms))
			c.end(a, at(3*h+100*ms), true, cached(0))
			c.end(b, at(3*h+200*ms), true, cached(0))
			c.end(x, at(3*h+210*ms), true, cached(0)) // 10 ms after b: behind two as it began
			return c.begin(1000, at(4*h)).expect
		}, 100 * ms},
		{"one begun behind another: its time from that one's end", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			learn(c, at, 1000, 100*ms)
			h := time.Hour
			a, b := c.begin(1000, at(h)), c.begin(1000, at(h+90*ms))
			c.end(a, at(h+100*ms), true, cached(0))
			c.end(b, at(h+120*ms), true, cached(0)) // 20 ms of its own
			return c.begin(1000, at(2*h)).expect
		}, 92 * ms}, // 100 ms, a tenth of the way to 20
		{"a slower engine is learned faster than a faster one", func(c *prefillClock, at func(time.Duration) time.Time) time.Duration {
			learn(c, at, 1000, 100*ms)
			c.end(c.begin(1000, at(time.Hour)), at(time.Hour+200*ms), true, cached(0))
			return c.begin(1000, at(2*time.Hour)).expect
		}, 150 * ms},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c prefillClock
			t0 := time.Unix(1000, 0)
			if got := tc.run(&c, func(d time.Duration) time.Time { return t0.Add(d) }); got != tc.want {
				t.Errorf("expected %v; want %v", got, tc.want)
			}
		})
	}
}

// A prediction of no time at all (an engine faster than the clock's
// resolution) is still a prediction: counted out as one, it leaves no
// unpredicted prefill behind it.
func TestPrefillClockCountsOut(t *testing.T) {
	var c prefillClock
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	learn(&c, at, 1000, 0)
	p := c.begin(1, at(time.Hour))
	c.end(p, at(time.Hour), true, cached(0))
	if c.unknown != 0 || c.running != 0 {
		t.Fatalf("after a prefill predicted to take no time: %d unknown, %d running; want 0, 0", c.unknown, c.running)
	}
	if q := c.begin(1000, at(2*time.Hour)); !q.known {
		t.Error("the next prefill was not predicted")
	}
}

// cached is what an engine's answer says it found cached.
func cached(n int) func() int { return func() int { return n } }

// learn runs clockSamples prefills of tokens one after another, a second
// apart from time 0, each taking d and finding nothing cached.
func learn(c *prefillClock, at func(time.Duration) time.Time, tokens int, d time.Duration) {
	for i := range clockSamples {
		start := time.Duration(i) * time.Second
		c.end(c.begin(tokens, at(start)), at(start+d), true, cached(0))
	}
}

func TestCachedTokens(t *testing.T) {
	for _, tc := range []struct {
		raw  string
		want int
	}{
		{`{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":64}}}`, 64},
		{`{"usage":{"prompt_tokens":100}}`, 0},
		{`{"choices":[]}`, 0},
		{`not json`, 0},
	} {
		if got := cachedTokens([]byte(tc.raw)); got != tc.want {
			t.Errorf("cachedTokens(%s) = %d; want %d", tc.raw, got, tc.want)
		}
	}
}
