package bench

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// PrefixRepetitionDataset is vLLM's "prefix_repetition" dataset
// (vllm/benchmarks/datasets/prefix_repetition.py) without a tokenizer:
// NumPrefixes prefixes of PrefixLen words, each followed by
// n/NumPrefixes suffixes of SuffixLen words, shuffled. Requests that share
// a prefix share its KV blocks, for a prefix cache to find.
type PrefixRepetitionDataset struct {
	PrefixLen, SuffixLen, NumPrefixes, OutputLen int
	Seed                                         uint64
}

// Sample makes NumPrefixes × (n / NumPrefixes) requests whose ids are prefix
// followed by their index; n must be at least NumPrefixes, as in vLLM.
func (d PrefixRepetitionDataset) Sample(n int, prefix string) ([]SampleRequest, error) {
	if d.NumPrefixes < 1 || d.PrefixLen < 0 || d.SuffixLen < 0 || d.PrefixLen+d.SuffixLen < 1 || d.OutputLen < 1 {
		return nil, fmt.Errorf("%w: --prefix-repetition-num-prefixes and -output-len must be at least 1, the prefix and suffix lengths not negative and not both 0", ErrInvalid)
	}
	per := n / d.NumPrefixes
	if per == 0 {
		return nil, fmt.Errorf("%w: num_requests (%d) must be greater than or equal to num_prefixes (%d)", ErrInvalid, n, d.NumPrefixes)
	}
	rng := rand.New(rand.NewPCG(d.Seed, 0x7072656669780a)) // "prefix"
	words := func(k int) []string {
		w := make([]string, k)
		for i := range w {
			w[i] = vocabulary[rng.IntN(len(vocabulary))]
		}
		return w
	}
	var reqs []SampleRequest
	for range d.NumPrefixes {
		pre := words(d.PrefixLen)
		for range per {
			reqs = append(reqs, SampleRequest{
				Prompt:    strings.Join(append(slices.Clone(pre), words(d.SuffixLen)...), " "),
				PromptLen: d.PrefixLen + d.SuffixLen,
				OutputLen: d.OutputLen,
			})
		}
	}
	rng.Shuffle(len(reqs), func(i, j int) { reqs[i], reqs[j] = reqs[j], reqs[i] })
	for i := range reqs {
		reqs[i].RequestID = prefix + strconv.Itoa(i)
	}
	return reqs, nil
}

// Mix is a weighted choice of names: "a:9,b:1" picks a nine times in ten.
type Mix struct {
	Names   []string
	Weights []float64
}

// ParseMix reads "name:weight,name:weight"; a name alone weighs 1.
func ParseMix(flag, s string) (Mix, error) {
	var m Mix
	if s == "" {
		return m, nil
	}
	for _, part := range strings.Split(s, ",") {
		name, w, hasWeight := strings.Cut(strings.TrimSpace(part), ":")
		weight := 1.0
		if hasWeight {
			f, err := strconv.ParseFloat(w, 64)
			if err != nil || !(f > 0) || math.IsInf(f, 0) {
				return Mix{}, fmt.Errorf("%w: %s: weight %q of %q is not a positive number", ErrInvalid, flag, w, name)
			}
			weight = f
		}
		if name == "" || slices.Contains(m.Names, name) {
			return Mix{}, fmt.Errorf("%w: %s: want distinct names with weights, as a:9,b:1; got %q", ErrInvalid, flag, s)
		}
		m.Names = append(m.Names, name)
		m.Weights = append(m.Weights, weight)
	}
	return m, nil
}

// assign gives each of n requests a name, in proportion to the weights,
// in a seeded random order: exactly round(n·share) each, the rounding
// going to the first names.
func (m Mix) assign(n int, rng *rand.Rand) []string {
	if len(m.Names) == 0 {
		return nil
	}
	var total float64
	for _, w := range m.Weights {
		total += w
	}
	out := make([]string, 0, n)
	for i, name := range m.Names {
		k := int(math.Round(float64(n) * m.Weights[i] / total))
		if i == len(m.Names)-1 {
			k = n - len(out)
		}
		for range min(k, n-len(out)) {
			out = append(out, name)
		}
	}
	for len(out) < n {
		out = append(out, m.Names[0])
	}
	rng.Shuffle(n, func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// applyMixes gives the requests their tenant (sent as the body's "user")
// and their priority (vLLM's "priority"), seeded: per conversation for
// multi-turn requests (every turn of one conversation is one tenant's, of
// one priority), else per request.
func applyMixes(reqs []SampleRequest, tenants, priorities Mix, seed uint64, conversations bool) error {
	rng := rand.New(rand.NewPCG(seed, 0x74656e616e74)) // "tenant"
	unit := func(i int) int { return i }
	n := len(reqs)
	if conversations {
		unit = func(i int) int { return reqs[i].Conversation }
		n = 0
		for _, r := range reqs {
			n = max(n, r.Conversation+1)
		}
	}
	ts, ps := tenants.assign(n, rng), priorities.assign(n, rng)
	for i := range reqs {
		if ts != nil {
			reqs[i].Tenant = ts[unit(i)]
		}
		if ps != nil {
			v, err := strconv.Atoi(ps[unit(i)])
			if err != nil {
				return fmt.Errorf("%w: --priorities: %q is not an integer priority", ErrInvalid, ps[unit(i)])
			}
			reqs[i].Priority = &v
		}
	}
	return nil
}

// Group is the figures of the requests of one tenant or one priority.
type Group struct {
	Key, Name string
	Metrics   Metrics
}

// groups splits the outputs by tenant, then by priority, and computes
// each group's metrics over the run's duration.
func groups(reqs []SampleRequest, outputs []Output, dur float64, goodput Goodput) []Group {
	var gs []Group
	split := func(key string, name func(SampleRequest) (string, bool)) {
		var names []string
		by := map[string][]Output{}
		for i, r := range reqs {
			n, ok := name(r)
			if !ok {
				return
			}
			if _, seen := by[n]; !seen {
				names = append(names, n)
			}
			by[n] = append(by[n], outputs[i])
		}
		slices.Sort(names)
		for _, n := range names {
			gs = append(gs, Group{Key: key, Name: n, Metrics: Calculate(by[n], dur, []float64{50, 99}, goodput)})
		}
	}
	split("tenant", func(r SampleRequest) (string, bool) { return r.Tenant, r.Tenant != "" })
	split("priority", func(r SampleRequest) (string, bool) {
		if r.Priority == nil {
			return "", false
		}
		return strconv.Itoa(*r.Priority), true
	})
	return gs
}

// writeExtras prints what pdq bench measures beyond vLLM's block: the
// share of prompt tokens the server reports as cached, and each tenant's
// and priority's figures.
func writeExtras(w io.Writer, outputs []Output, gs []Group, goodput bool) error {
	var lines []string
	prompt, cached, reported := 0, 0, false
	for _, o := range outputs {
		if o.Success {
			prompt += o.PromptLen
			cached += o.CachedTokens
			reported = reported || o.CachedReported
		}
	}
	if reported {
		share := 0.0
		if prompt > 0 {
			share = 100 * float64(cached) / float64(prompt)
		}
		lines = append(lines, intLine("Cached prompt tokens:", cached), floatLine("Cached share of prompt tokens (%):", share))
	}
	for _, g := range gs {
		m := g.Metrics
		lines = append(lines, center(" "+g.Key+" "+g.Name+" ", '-', 50),
			intLine("Successful requests:", m.Completed),
			intLine("Failed requests:", m.Failed))
		if goodput {
			lines = append(lines, floatLine("Request goodput (req/s):", m.RequestGoodput))
		}
		lines = append(lines,
			floatLine("Median TTFT (ms):", m.TTFT.Median),
			floatLine("P99 TTFT (ms):", percentileOf(m.TTFT, 99)),
			floatLine("P99 TPOT (ms):", percentileOf(m.TPOT, 99)))
	}
	if len(lines) == 0 {
		return nil
	}
	_, err := io.WriteString(w, strings.Join(append(lines, strings.Repeat("=", 50)), "\n")+"\n")
	return err
}

func percentileOf(s Stat, p float64) float64 {
	for _, v := range s.Percentiles {
		if v[0] == p {
			return v[1]
		}
	}
	return math.NaN()
}
