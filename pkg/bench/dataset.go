package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
)

// SampleRequest is one request of a dataset, vLLM's SampleRequest.
type SampleRequest struct {
	Prompt string
	// PromptLen is the prompt's length in words, which is its length in
	// tokens for pdq sim; the count of input tokens is taken from the
	// response's usage.prompt_tokens when it has one.
	PromptLen int
	// OutputLen is the max_tokens (max_completion_tokens) sent.
	OutputLen int
	// RequestID is the X-Request-Id sent: the prefix and the index.
	RequestID string
	// Tenant, if set, is sent as the body's "user"; Priority, if set, as
	// vLLM's "priority".
	Tenant   string
	Priority *int
	// Conversation and Turn place a multi-turn request; History is the
	// conversation before it, set when the turn is sent.
	Conversation, Turn int
	History            []Message
}

// RandomDataset is vLLM's "random" dataset without a tokenizer. vLLM
// samples token ids and decodes them; pdq has no tokenizer, so a prompt is
// words from a fixed vocabulary of short, common, lower-case English words,
// joined by single spaces. Each word is one token for pdq sim (a run of
// letters, see tokenizer.CountTokens) and, with its leading space, one token for
// most BPE tokenizers, so a real engine sees about the asked length (plus
// the BOS token it adds).
//
// As in vLLM (vllm/benchmarks/datasets: RandomDataset.get_sampling_params)
// input and output lengths are drawn uniformly from the integers in
// [floor(len*(1-r)), ceil(len*(1+r))], r being RangeRatio in [0, 1), the
// output length at least 1; PrefixLen words, drawn once, start every
// prompt. The words themselves are drawn independently per position, so
// that two prompts share no prefix beyond PrefixLen that a prefix cache
// could find.
type RandomDataset struct {
	InputLen, OutputLen, PrefixLen int
	RangeRatio                     float64
	Seed                           uint64
}

// Sample makes n requests whose ids are prefix followed by their index.
func (d RandomDataset) Sample(n int, prefix string) ([]SampleRequest, error) {
	r := d.RangeRatio
	if !(r >= 0 && r < 1) {
		return nil, fmt.Errorf("%w: --random-range-ratio must be in [0, 1), got %v", ErrInvalid, r)
	}
	if d.InputLen < 0 || d.OutputLen < 0 || d.PrefixLen < 0 {
		return nil, fmt.Errorf("%w: --random-input-len, --random-output-len and --random-prefix-len must not be negative", ErrInvalid)
	}
	inLow := int(math.Floor(float64(d.InputLen) * (1 - r)))
	inHigh := int(math.Ceil(float64(d.InputLen) * (1 + r)))
	outLow := max(int(math.Floor(float64(d.OutputLen)*(1-r))), 1)
	outHigh := max(int(math.Ceil(float64(d.OutputLen)*(1+r))), 1)
	if d.PrefixLen+inLow < 1 {
		return nil, fmt.Errorf("%w: --random-input-len is too small: the shortest prompt (prefix + sampled) would have %d tokens", ErrInvalid, d.PrefixLen+inLow)
	}
	rng := rand.New(rand.NewPCG(d.Seed, 0x62656e6368)) // "bench"
	between := func(lo, hi int) int { return lo + rng.IntN(hi-lo+1) }
	inLens := make([]int, n)
	outLens := make([]int, n)
	for i := range n {
		inLens[i] = between(inLow, inHigh)
	}
	for i := range n {
		outLens[i] = between(outLow, outHigh)
	}
	var pre strings.Builder
	for i := range d.PrefixLen {
		if i > 0 {
			pre.WriteByte(' ')
		}
		pre.WriteString(vocabulary[rng.IntN(len(vocabulary))])
	}
	reqs := make([]SampleRequest, n)
	for i := range reqs {
		var b strings.Builder
		b.WriteString(pre.String())
		for j := range inLens[i] {
			if j > 0 || d.PrefixLen > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(vocabulary[rng.IntN(len(vocabulary))])
		}
		reqs[i] = SampleRequest{
			Prompt:    b.String(),
			PromptLen: d.PrefixLen + inLens[i],
			OutputLen: outLens[i],
			RequestID: prefix + strconv.Itoa(i),
		}
	}
	return reqs, nil
}

// vocabulary are the words prompts are made of: letters only, so that
// each is one token for pdq sim.
var vocabulary = strings.Fields(`
	the of and to in is it you that he was for on are as with his they at be
	this have from or one had by word but not what all were we when your can
	said there use an each which she do how their if will up other about out
	many then them these so some her would make like him into time has look
	two more write go see number no way could people my than first water been
	call who oil its now find long down day did get come made may part over
	new sound take only little work know place year live me back give most
	very after thing our just name good man think say great where help through
	much before line right too mean old any same tell boy follow came want
	show also around form three small set put end does another well large must
	big even such because turn here why ask went men read need land different
	home us move try kind hand picture again change off play spell air away
	animal house point page letter mother answer found study still learn
	should world high every near add food between own below country plant last
	school father keep tree never start city earth eye light thought head under
	story saw left few while along might close something seem next hard open
	example begin life always those both paper together got group often run`)
