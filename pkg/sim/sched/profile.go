package sched

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"time"
)

// Profile is an engine calibrated to a measured run: its scheduler, KV
// cache and step costs, and the cost of reading its KV blocks.
type Profile struct {
	Name   string
	Config Config
	// TransferPerBlock and TransferBase price a decode engine's read of a
	// prefill's blocks: per block, and once per read.
	TransferPerBlock, TransferBase time.Duration
}

// Seed is calibrated to the run that measured the P/D handshake fix
// (AIBrix PR #1429): Qwen3-8B, one engine per GPU, vLLM bench serve with
// --random-input-len 8000 --random-output-len 200 --request-rate 1
// --burstiness 100 --ignore-eos, 200 prompts. With the KV read, TTFT
// averaged about 1,256 ms and TPOT 9.0 ms; with a router that dropped
// kv_transfer_params the decode engine prefilled every prompt again, fell
// behind (0.85 requests a second, 236 s for the run) and TTFT averaged
// about 14 s.
//
// vLLM's defaults where it has them: 16-token blocks, max_num_seqs 256,
// max_num_batched_tokens 8192, prefix caching on, fcfs. The KV capacity,
// 16,384 blocks (262,144 tokens), is about what 80 GB leaves for
// Qwen3-8B's 144 KiB a token. The costs are fitted to the three figures:
// a prefill computes 10,000 tokens a second (an 8,000-token prompt in
// 0.8 s), a decode step costs 6 ms plus 195 ns for each token of context
// its sequences attend to (9 ms for the two 8,100-token sequences the
// good run keeps running), and a read of the prompt's 500 blocks 420 ms.
// The broken run's figures come from the decode engine's saturation: the
// context cost decides where it saturates, and TTFT then grows with the
// length of the run.
var Seed = Profile{
	Name: "seed",
	Config: Config{
		BlockSize: 16, NumBlocks: 16384, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192,
		PrefixCaching: true, Policy: FCFS,
		Cost: Cost{Base: 6 * time.Millisecond, PerPrefillToken: 100 * time.Microsecond, PerContextToken: 195 * time.Nanosecond},
	},
	TransferPerBlock: 840 * time.Microsecond,
	TransferBase:     2 * time.Millisecond,
}

// Profiles are the calibrated profiles by name.
func Profiles() map[string]Profile {
	return map[string]Profile{Seed.Name: Seed}
}

// PD is the profile's P/D pair with a router that costs hop a leg.
func (p Profile) PD(hop time.Duration) PD {
	return PD{Prefill: p.Config, Decode: p.Config, TransferPerBlock: p.TransferPerBlock, TransferBase: p.TransferBase, Hop: hop}
}

// RandomArrivals are n requests as vLLM bench serve's random dataset
// sends them: prompts of distinct random tokens (no shared prefix) of in
// tokens, out output tokens, at rate requests a second with gamma
// distributed gaps of shape burstiness (1 is Poisson), seeded.
func RandomArrivals(n, in, out int, rate, burstiness float64, blockSize int, seed uint64) []Arrival {
	rng := rand.New(rand.NewPCG(seed, 0xbe9c4))
	arr := make([]Arrival, n)
	var at float64
	for i := range arr {
		hashes := make([]uint64, in/blockSize)
		for k := range hashes {
			hashes[k] = rng.Uint64() | 1
		}
		arr[i] = Arrival{At: time.Duration(at * float64(time.Second)), PromptTokens: in, Hashes: hashes, OutputTokens: out}
		at += gamma(rng, burstiness) / (rate * burstiness)
	}
	return arr
}

// gamma draws from Gamma(shape, 1) (Marsaglia and Tsang).
func gamma(rng *rand.Rand, shape float64) float64 {
	if shape < 1 {
		return gamma(rng, shape+1) * math.Pow(rng.Float64(), 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := rng.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := rng.Float64()
		if math.Log(u) < 0.5*x*x+d-d*v+d*math.Log(v) {
			return d * v
		}
	}
}

// Summary is vLLM bench's figures of a run, in milliseconds.
type Summary struct {
	MeanTTFT, P99TTFT, MeanTPOT, P99TPOT float64
}

// Summarize computes the means and 99th percentiles as vLLM bench does
// (numpy's linear interpolation).
func Summarize(outs []Outcome) Summary {
	var ttft, tpot []float64
	for _, o := range outs {
		ttft = append(ttft, ms(o.TTFT))
		if o.Output > 1 {
			tpot = append(tpot, ms(o.TPOT()))
		}
	}
	return Summary{MeanTTFT: mean(ttft), P99TTFT: percentile(ttft, 99), MeanTPOT: mean(tpot), P99TPOT: percentile(tpot, 99)}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	rank := p / 100 * float64(len(s)-1)
	lo := int(math.Floor(rank))
	hi := min(lo+1, len(s)-1)
	return s[lo] + (s[hi]-s[lo])*(rank-float64(lo))
}
