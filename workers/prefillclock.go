package workers

import (
	"encoding/json"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// prefillLead is how long before its engine's prefill is expected to end
// a prefill worker tells the gateway that it ended (Job.ReplyPrefilled): about
// the time the gateway's next request takes to reach the engine (the
// turn, the publish, a worker's pull, the engine call), so that it comes
// as the engine frees, not that long after. Told too early, the next
// prompt waits that much in the engine; too late, the engine idles.
const prefillLead = 20 * time.Millisecond

// prefillClock learns how long the worker's engine takes a prompt token
// when it prefills a prompt and finds none of it cached, and predicts
// from that when a prefill will end: one that begins with the engine idle
// after its own time, one that begins behind another (told early, the
// gateway sent it before that one ended) after that one's too, as the
// engine runs a prompt that fits in a step once the step before it ends.
type prefillClock struct {
	mu      sync.Mutex
	running int // prefills in flight
	unknown int // of those, the ones whose end was not predicted
	// freeAt is when the prefills in flight are expected to have ended,
	// when all of them were predicted; lastEnd when the last one ended.
	freeAt, lastEnd time.Time
	perToken        float64 // ns a prompt token, a moving average
	samples         int
}

// clockSamples is how many prefills the clock learns from before it
// predicts. A sample slower than the average moves it by clockUp of the
// difference, a faster one by clockDown: an engine that does not say what
// it found cached teaches the clock cached prompts' short times too, and
// a prediction too short costs more (the next prompt waits in the engine,
// whatever its turn) than one too long (the engine idles a hand-off, as
// it would without the clock).
const (
	clockSamples = 3
	clockUp      = 0.5
	clockDown    = 0.1
)

// prefillTiming is one prefill's, from begin to end.
type prefillTiming struct {
	tokens int
	began  time.Time
	// ahead is how many of the worker's prefills were in flight as it
	// began: with none, its time is its own; behind one, its own time
	// starts as that one ends.
	ahead int
	// known says its end was predicted: expect is how long it is
	// expected to take from its begin.
	known  bool
	expect time.Duration
}

// begin counts a prefill of about tokens prompt tokens in, at now.
func (c *prefillClock) begin(tokens int, now time.Time) prefillTiming {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := prefillTiming{tokens: tokens, began: now, ahead: c.running}
	c.running++
	if tokens <= 0 || c.samples < clockSamples || c.unknown > 0 {
		c.unknown++
		return t
	}
	start := now
	if t.ahead > 0 && c.freeAt.After(now) {
		start = c.freeAt
	}
	c.freeAt = start.Add(time.Duration(c.perToken * float64(tokens)))
	t.known, t.expect = true, c.freeAt.Sub(now)
	return t
}

// end counts the prefill out at now. One that found nothing cached
// (cached tokens, as its engine answered: read only for a prefill the
// clock would learn from) and began with the engine idle, or behind one
// other that ended before it, teaches the clock its time.
func (c *prefillClock) end(t prefillTiming, now time.Time, ok bool, cached func() int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.running--
	if !t.known {
		c.unknown--
	}
	from := t.began
	if t.ahead == 1 && c.lastEnd.After(from) {
		from = c.lastEnd // the one ahead of it ended since it began
	}
	alone := t.ahead == 0 || (t.ahead == 1 && from != t.began)
	c.lastEnd = now
	if c.running == 0 {
		c.freeAt = time.Time{}
	}
	if !ok || !alone || t.tokens <= 0 || cached() > 0 {
		return
	}
	sample := float64(now.Sub(from)) / float64(t.tokens)
	switch {
	case c.samples == 0:
		c.perToken = sample
	case sample > c.perToken:
		c.perToken += clockUp * (sample - c.perToken)
	default:
		c.perToken += clockDown * (sample - c.perToken)
	}
	c.samples++
}

// prefilledTeller counts one prefill in the worker's clock and tells the
// gateway of its job that it ended, when the gateway asked (see
// Worker.tellPrefilled).
type prefilledTeller struct {
	clock        *prefillClock
	timing       prefillTiming
	answeredOnce bool
	tell         func()      // once; nil when the gateway did not ask
	early        *time.Timer // tells before the expected end; nil if none
}

// answered says the engine answered the prefill (ok: with a success,
// raw), or that the call ended without (!ok): the clock counts it out,
// learning from a success; a failure stops the early telling. Only the
// first call counts.
func (p *prefilledTeller) answered(ok bool, raw []byte) {
	if p.answeredOnce {
		return
	}
	p.answeredOnce = true
	p.clock.end(p.timing, time.Now(), ok, func() int { return cachedTokens(raw) })
	if !ok && p.early != nil {
		p.early.Stop()
	}
}

// close ends the prefill's telling, however its handler returns: a
// prefill the clock did not count out (a panic) is counted out unanswered,
// and the early telling stops (a prefill that failed after it was told is
// retried or answered without a turn).
func (p *prefilledTeller) close() {
	p.answered(false, nil)
	if p.early != nil {
		p.early.Stop()
	}
}

// ended tells the gateway now, if it asked and was not told before: the
// prefill succeeded, and its handoff is on its way.
func (p *prefilledTeller) ended() {
	if p.tell != nil {
		p.tell()
	}
}

// cachedTokens is the prompt tokens an engine's answer says it found
// cached (vLLM's usage.prompt_tokens_details.cached_tokens, with
// --enable-prompt-tokens-details); 0 when it does not say.
func cachedTokens(raw []byte) int {
	var r struct {
		Usage *openai.Usage `json:"usage"`
	}
	if json.Unmarshal(raw, &r) != nil || r.Usage == nil || r.Usage.PromptTokensDetails == nil {
		return 0
	}
	return r.Usage.PromptTokensDetails.CachedTokens
}
