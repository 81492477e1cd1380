package main

import (
	"fmt"
	"math"
	"slices"
	"strings"

	pdqbench "github.com/pdq-dev/pdq/pkg/bench"
)

// workload is one load of the sweep: a pdq bench dataset, its mixes, and
// the rates it is run at.
type workload struct {
	key, title string
	// conversations: the rate is of conversations a second, each of turns
	// requests (multi_turn).
	conversations bool
	// multiples are the rates of the sweep, as multiples of the
	// workload's capacity with no cache hit.
	multiples []float64
	// priorityEngines runs the engines with --scheduling-policy priority.
	priorityEngines bool
	// set fills in the dataset and mixes of a run's configuration.
	set func(*pdqbench.Config)
	// sample is the dataset as pdq bench draws it from cfg (set's
	// fields), n requests (or conversations), with a conversation's
	// history filled in with answers of the output length.
	sample func(cfg pdqbench.Config, n int) ([]pdqbench.SampleRequest, error)
	// multipleOf is the number of requests a run's count is rounded
	// down to a multiple of (its prefixes, its tenant mix's total weight).
	multipleOf int
}

// The workloads' shapes. Prompts are a few thousand tokens, so that
// prefill is the engines' bottleneck, as it is for the seed profile's
// calibration run (8,000-token prompts); answers are short, so that the
// streamed tokens (one SSE event each, through the router and the client)
// keep within what two CPUs relay without becoming the bottleneck
// themselves.
const (
	outputLen = 32
	randomLen = 2048
	// prefix_repetition: 32 shared prefixes of 2,048 words, each followed
	// by 512 words of its own.
	prefixLen, suffixLen, numPrefixes = 2048, 512, 32
	// multi_turn: 5 turns of 400 words; the first starts with 500 words
	// that every conversation shares and 1,000 of its own. Think time is
	// vLLM's 1 s, time-scaled.
	turns, commonPrefixLen, convPrefixLen, userLen = 5, 500, 1000, 400
	// tenants: "a" sends ten times what "b" sends.
	bigTenant, smallTenant = "a", "b"
)

func allWorkloads(timeScale float64) []workload {
	random := func(cfg *pdqbench.Config) {
		cfg.DatasetName, cfg.RandomInputLen, cfg.RandomOutputLen = "random", randomLen, outputLen
	}
	sampleRandom := func(cfg pdqbench.Config, n int) ([]pdqbench.SampleRequest, error) {
		return pdqbench.RandomDataset{InputLen: cfg.RandomInputLen, OutputLen: cfg.RandomOutputLen, PrefixLen: cfg.RandomPrefixLen,
			RangeRatio: cfg.RandomRangeRatio, Seed: uint64(cfg.Seed)}.Sample(n, "")
	}
	noReuse := []float64{0.6, 1.0, 1.4}
	return []workload{
		{
			key: "multi_turn", title: "multi-turn chat", conversations: true, multiples: []float64{1, 2, 2.5, 3},
			set: func(cfg *pdqbench.Config) {
				cfg.DatasetName = "multi_turn"
				cfg.MultiTurnTurns, cfg.MultiTurnCommonPrefixLen, cfg.MultiTurnPrefixLen = turns, commonPrefixLen, convPrefixLen
				cfg.MultiTurnUserLen, cfg.MultiTurnOutputLen, cfg.MultiTurnThinkTime = userLen, outputLen, timeScale
			},
			sample: func(cfg pdqbench.Config, n int) ([]pdqbench.SampleRequest, error) {
				reqs, err := pdqbench.MultiTurnDataset{Turns: cfg.MultiTurnTurns, CommonPrefixLen: cfg.MultiTurnCommonPrefixLen,
					PrefixLen: cfg.MultiTurnPrefixLen, UserLen: cfg.MultiTurnUserLen, OutputLen: cfg.MultiTurnOutputLen,
					Seed: uint64(cfg.Seed)}.Sample(n, "")
				if err != nil {
					return nil, err
				}
				answer := strings.TrimSpace(strings.Repeat("word ", cfg.MultiTurnOutputLen))
				return withHistory(reqs, func(int) string { return answer }), nil
			},
		},
		{
			key: "prefix_repetition", title: "prefix_repetition", multiples: []float64{0.8, 1.4, 1.55, 1.7, 2.0}, multipleOf: numPrefixes,
			set: func(cfg *pdqbench.Config) {
				cfg.DatasetName = "prefix_repetition"
				cfg.PrefixRepetitionPrefixLen, cfg.PrefixRepetitionSuffixLen = prefixLen, suffixLen
				cfg.PrefixRepetitionNumPrefixes, cfg.PrefixRepetitionOutputLen = numPrefixes, outputLen
			},
			sample: func(cfg pdqbench.Config, n int) ([]pdqbench.SampleRequest, error) {
				return pdqbench.PrefixRepetitionDataset{PrefixLen: cfg.PrefixRepetitionPrefixLen, SuffixLen: cfg.PrefixRepetitionSuffixLen,
					NumPrefixes: cfg.PrefixRepetitionNumPrefixes, OutputLen: cfg.PrefixRepetitionOutputLen, Seed: uint64(cfg.Seed)}.Sample(n, "")
			},
		},
		{key: "random", title: "random (no shared prefix)", multiples: []float64{0.6, 0.8, 1.0, 1.4}, set: random, sample: sampleRandom},
		{
			key: "tenants", title: "tenants 10:1", multiples: noReuse, multipleOf: 11, sample: sampleRandom,
			set: func(cfg *pdqbench.Config) {
				random(cfg)
				cfg.Tenants = bigTenant + ":10," + smallTenant + ":1"
			},
		},
		{
			key: "priority", title: "priority 0 among priority 1", multiples: noReuse, priorityEngines: true, sample: sampleRandom,
			set: func(cfg *pdqbench.Config) {
				random(cfg)
				cfg.Priorities = "0:1,1:9"
			},
		},
	}
}

// withHistory gives each turn of the conversations in reqs (in
// conversation-major order) the conversation before it, with the answer
// of request i given by answer.
func withHistory(reqs []pdqbench.SampleRequest, answer func(i int) string) []pdqbench.SampleRequest {
	out := slices.Clone(reqs)
	var history []pdqbench.Message
	for i := range out {
		if out[i].Turn == 0 {
			history = nil
		}
		out[i].History = slices.Clone(history)
		history = append(history, pdqbench.Message{Role: "user", Text: out[i].Prompt}, pdqbench.Message{Role: "assistant", Text: answer(i)})
	}
	return out
}

// plan is a workload's figures before it runs: its capacity with no
// cache hit, the SLO, the rates of its sweep.
type plan struct {
	w workload
	// meanPrompt is the mean prompt in tokens (as the engines count
	// them), idealShare what a perfectly affine router would find cached
	// in a run of the nominal size.
	meanPrompt, idealShare float64
	// capacity is in the workload's rate unit: requests a second, or
	// conversations a second.
	capacity float64
	slo      slo
	rates    []float64
}

// unit is the workload's rate unit.
func (w workload) unit() string {
	if w.conversations {
		return "conv/s"
	}
	return "req/s"
}

// planOf works out w's capacity, SLO and rates on engines prefill
// engines of model, with sloFactor and the rate multiples given (nil:
// the workload's own).
func planOf(w workload, model engineModel, engines int, seed int64, sloFactor float64, multiples []float64) (plan, error) {
	cfg := pdqbench.DefaultConfig()
	cfg.Seed = seed
	w.set(&cfg)
	n := 200
	if w.conversations {
		n = 40
	}
	reqs, err := w.sample(cfg, n)
	if err != nil {
		return plan{}, err
	}
	share, mean, err := cacheShare(model, reqs)
	if err != nil {
		return plan{}, err
	}
	p := plan{w: w, meanPrompt: mean, idealShare: share, slo: model.sloOf(mean, outputLen, sloFactor)}
	p.capacity = model.prefillCapacity(engines, mean)
	if w.conversations {
		p.capacity /= float64(cfg.MultiTurnTurns)
	}
	if multiples == nil {
		multiples = w.multiples
	}
	p.rates = rates(p.capacity, multiples)
	if len(p.rates) == 0 {
		return plan{}, fmt.Errorf("%s: no rate in %v times %.3g", w.key, multiples, p.capacity)
	}
	return p, nil
}

// count is the number of requests (or conversations) of a run at rate
// that sends for about seconds, at least min, rounded down to the
// workload's multiple.
func (w workload) count(rate, seconds float64, least int) int {
	n := max(int(math.Round(rate*seconds)), least)
	if w.multipleOf > 1 {
		n = max(n/w.multipleOf, 1) * w.multipleOf
	}
	return n
}
