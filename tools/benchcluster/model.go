package main

import (
	"fmt"
	"math"
	"strconv"
	"time"

	pdqbench "github.com/pdq-dev/pdq/pkg/bench"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// engineModel is what the simulated engines cost, from the profile they
// run (pdq sim --profile, time-scaled): the figures the rates and the
// SLOs are derived from.
type engineModel struct {
	base, perPrefillToken, perDecodeSeq, perContextToken time.Duration
	transferBase, transferPerBlock                       time.Duration
	blockSize, budget, mmTokens                          int
}

// modelOf is the profile's engine at timeScale, as pdq sim runs it.
func modelOf(profile string, timeScale float64) (engineModel, error) {
	c := simconfig.DefaultConfig()
	c.Profile, c.TimeScale = profile, timeScale
	if err := c.Validate(); err != nil {
		return engineModel{}, err
	}
	s, perBlock, perRead := c.Sched()
	return engineModel{
		base: s.Cost.Base, perPrefillToken: s.Cost.PerPrefillToken, perDecodeSeq: s.Cost.PerDecodeSeq,
		perContextToken: s.Cost.PerContextToken, transferBase: perRead, transferPerBlock: perBlock,
		blockSize: s.BlockSize, budget: s.MaxNumBatchedTokens, mmTokens: c.MMTokens,
	}, nil
}

// idleTTFT is the time to first token of a lone request of prompt tokens
// that no cache holds: its prefill (in steps of the token budget), the
// decode engine's read of every block, and the decode engine's first step
// (the last prompt token, then the first output token).
func (m engineModel) idleTTFT(prompt int) time.Duration {
	steps := (prompt + m.budget - 1) / m.budget
	prefill := time.Duration(steps)*m.base + time.Duration(prompt)*m.perPrefillToken
	blocks := (prompt + m.blockSize - 1) / m.blockSize
	read := m.transferBase + time.Duration(blocks)*m.transferPerBlock
	return prefill + read + m.base + m.perPrefillToken
}

// idleTPOT is the time per output token of a lone sequence whose context
// is context tokens.
func (m engineModel) idleTPOT(context int) time.Duration {
	return m.base + m.perDecodeSeq + time.Duration(context)*m.perContextToken
}

// prefillCapacity is how many requests of prompt tokens, none of them
// cached, engines prefill engines finish a second: each step full (the
// token budget), so that its base cost is shared.
func (m engineModel) prefillCapacity(engines int, prompt float64) float64 {
	if prompt <= 0 {
		return math.Inf(1)
	}
	step := m.base + time.Duration(m.budget)*m.perPrefillToken
	tokensPerSecond := float64(m.budget) / step.Seconds()
	return float64(engines) * tokensPerSecond / prompt
}

// sloOf is the goodput objective of a workload whose requests have
// prompt tokens and output tokens on average: factor times the idle TTFT
// of such a prompt with no cache hit, and factor times the idle TPOT at
// its mean context; in whole milliseconds, rounded up.
func (m engineModel) sloOf(prompt, output, factor float64) slo {
	ttft := factor * float64(m.idleTTFT(int(math.Round(prompt)))) / float64(time.Millisecond)
	tpot := factor * float64(m.idleTPOT(int(math.Round(prompt+output/2)))) / float64(time.Millisecond)
	return slo{TTFT: math.Ceil(ttft), TPOT: math.Ceil(tpot)}
}

// slo is a goodput objective, in milliseconds, as vLLM's --goodput.
type slo struct{ TTFT, TPOT float64 }

func (s slo) goodput() []string {
	return []string{fmt.Sprintf("ttft:%g", s.TTFT), fmt.Sprintf("tpot:%g", s.TPOT)}
}

func (s slo) String() string { return fmt.Sprintf("TTFT <= %g ms, TPOT <= %g ms", s.TTFT, s.TPOT) }

// rates are the multiples of capacity, rounded to two significant
// digits, in increasing order, without repeats.
func rates(capacity float64, multiples []float64) []float64 {
	var out []float64
	for _, k := range multiples {
		r := round2(k * capacity)
		if r <= 0 || len(out) > 0 && r <= out[len(out)-1] {
			continue
		}
		out = append(out, r)
	}
	return out
}

// round2 rounds x to two significant digits.
func round2(x float64) float64 {
	if x <= 0 || math.IsInf(x, 0) || math.IsNaN(x) {
		return 0
	}
	f, _ := strconv.ParseFloat(strconv.FormatFloat(x, 'g', 2, 64), 64)
	return f
}

// promptIDs are the token ids a pdq sim engine computes for a chat
// request of the openai-chat backend: the body pdq bench sends, read as
// the engine reads it, through the sim's chat template and tokenizer.
func promptIDs(model engineModel, req pdqbench.SampleRequest) ([]int, error) {
	body, err := pdqbench.ChatBody("pdq-sim", req)
	if err != nil {
		return nil, err
	}
	r, oerr := openai.DecodeRequest(openai.Chat, body)
	if oerr != nil {
		return nil, fmt.Errorf("%s", oerr.Message)
	}
	text, err := tokenizer.Render(r.Messages, tokenizer.ChatTemplate{AddGenerationPrompt: true})
	if err != nil {
		return nil, err
	}
	return text.IDs(model.mmTokens), nil
}

// cacheShare is what a prefix cache could give the requests, in order:
// the share of their prompt tokens that a perfectly affine router finds
// cached, one that sends every request to the engine that has seen its
// prefix, with a cache that never evicts (every earlier prompt's blocks
// are there). As in vLLM, a hit is whole leading blocks, capped so that
// the last prompt token is computed. It also returns the mean prompt
// length in tokens.
func cacheShare(model engineModel, reqs []pdqbench.SampleRequest) (share, meanPrompt float64, err error) {
	seen := map[uint64]bool{}
	var hits, total int
	for _, req := range reqs {
		ids, err := promptIDs(model, req)
		if err != nil {
			return 0, 0, err
		}
		hashes := tokenizer.BlockHashes(ids, "", model.blockSize)
		k := 0
		for k < len(hashes) && seen[hashes[k]] {
			k++
		}
		hits += min(k, (len(ids)-1)/model.blockSize) * model.blockSize
		total += len(ids)
		for _, h := range hashes {
			seen[h] = true
		}
	}
	if total == 0 {
		return 0, 0, nil
	}
	return float64(hits) / float64(total), float64(total) / float64(len(reqs)), nil
}
