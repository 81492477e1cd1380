package bench

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
)

// ErrInvalid means a setting is wrong; the message says which.
var ErrInvalid = errors.New("invalid setting")

// Config is a run's settings: vLLM's `vllm bench serve` arguments that pdq
// bench has, with vLLM's names (as flags) and defaults.
type Config struct {
	// BaseURL is the server's base URL; empty means http://Host:Port.
	BaseURL string
	Host    string
	Port    int
	// Endpoint is the API path; empty means the backend's:
	// /v1/completions for openai, /v1/chat/completions for openai-chat.
	Endpoint string
	// Backend is openai (or its alias vllm: completions) or openai-chat.
	Backend string
	// Model is the model name sent; empty means the first model of the
	// server's /v1/models.
	Model string
	// DatasetName is random or prefix_repetition.
	DatasetName      string
	RandomInputLen   int
	RandomOutputLen  int
	RandomRangeRatio float64
	RandomPrefixLen  int
	// The prefix_repetition dataset's: prefixes shared by the requests.
	PrefixRepetitionPrefixLen, PrefixRepetitionSuffixLen   int
	PrefixRepetitionNumPrefixes, PrefixRepetitionOutputLen int
	// The multi_turn dataset's: conversations of MultiTurnTurns user
	// messages, each turn sent MultiTurnThinkTime seconds after the
	// previous answer.
	MultiTurnTurns, MultiTurnCommonPrefixLen, MultiTurnPrefixLen int
	MultiTurnUserLen, MultiTurnOutputLen                         int
	MultiTurnThinkTime                                           float64
	// Tenants is "name:weight,...": each request's "user"; Priorities is
	// "priority:weight,...": each request's vLLM "priority". The result
	// block is followed by each tenant's and each priority's figures.
	Tenants, Priorities string
	// InputLen and OutputLen are vLLM's general lengths: when set (not
	// 0), they are the dataset's (--random-input-len, --random-output-len).
	InputLen   int
	OutputLen  int
	NumPrompts int
	// NumWarmups requests (the first prompt) run after the initial test
	// run and before the measured ones, and are not counted.
	NumWarmups int
	// ReadyCheckTimeoutSec bounds the initial test run: the first prompt
	// is sent, every 5 s again until it succeeds, for as long; 0 skips it.
	ReadyCheckTimeoutSec int
	// Tokenizer is vLLM's --tokenizer. pdq bench loads none: prompts are
	// made of words (one token each on pdq sim) and output tokens are the
	// server's usage; a run that names one says so once.
	Tokenizer string
	// RequestRate is requests per second; +Inf sends all at once.
	RequestRate float64
	Burstiness  float64
	// MaxConcurrency caps the requests in flight; 0 means no cap.
	MaxConcurrency int
	// PercentileMetrics is the comma-separated metrics to print.
	PercentileMetrics string
	// MetricPercentiles is the comma-separated percentiles to print.
	MetricPercentiles string
	Seed              int64
	// Goodput are KEY:VALUE objectives in ms (ttft, tpot, e2el).
	Goodput        []string
	SaveResult     bool
	SaveDetailed   bool
	ResultDir      string
	ResultFilename string
	Label          string
	DisableTQDM    bool
	// RequestIDPrefix starts every X-Request-Id; the index follows.
	RequestIDPrefix string
	// PDPrefill is a prefill engine's base URL: each request's prefill leg
	// goes there first and its decode leg to BaseURL (see [Run]).
	PDPrefill string
	// APIKey, if set, is sent as "Authorization: Bearer <APIKey>" (vLLM
	// reads OPENAI_API_KEY).
	APIKey string
}

// DefaultConfig is vLLM's defaults, with a fresh request id prefix
// bench-<8 hex digits>- as vLLM makes one per run.
func DefaultConfig() Config {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return Config{
		Host:                        "127.0.0.1",
		Port:                        8000,
		Backend:                     "openai",
		DatasetName:                 "random",
		RandomInputLen:              1024,
		RandomOutputLen:             128,
		PrefixRepetitionPrefixLen:   256,
		PrefixRepetitionSuffixLen:   256,
		PrefixRepetitionNumPrefixes: 10,
		PrefixRepetitionOutputLen:   128,
		MultiTurnTurns:              6,
		MultiTurnCommonPrefixLen:    500,
		MultiTurnPrefixLen:          1000,
		MultiTurnUserLen:            140,
		MultiTurnOutputLen:          100,
		MultiTurnThinkTime:          1,
		NumPrompts:                  1000,
		ReadyCheckTimeoutSec:        600,
		RequestRate:                 math.Inf(1),
		Burstiness:                  1.0,
		PercentileMetrics:           "ttft,tpot,itl",
		MetricPercentiles:           "99",
		RequestIDPrefix:             "bench-" + hex.EncodeToString(b[:]) + "-",
	}
}

// RegisterFlags binds c to vLLM's flag names, with c's values as defaults.
// Give the flag set's arguments through [JoinNargs] first, so that
// --goodput takes several values as in vLLM.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.BaseURL, "base-url", c.BaseURL, "server or API base URL, if not http://HOST:PORT")
	fs.StringVar(&c.Host, "host", c.Host, "server host, without --base-url")
	fs.IntVar(&c.Port, "port", c.Port, "server port, without --base-url")
	fs.StringVar(&c.Endpoint, "endpoint", c.Endpoint, "API endpoint (default /v1/completions for openai, /v1/chat/completions for openai-chat)")
	fs.StringVar(&c.Backend, "backend", c.Backend, "openai (completions) or openai-chat")
	fs.StringVar(&c.Model, "model", c.Model, "model name (default: the first model of the server's /v1/models)")
	fs.StringVar(&c.DatasetName, "dataset-name", c.DatasetName, "dataset: random, prefix_repetition (prompts that share one of a few prefixes), or multi_turn (conversations: --num-prompts of them, started at --request-rate; openai-chat only)")
	fs.IntVar(&c.RandomInputLen, "random-input-len", c.RandomInputLen, "input tokens per request")
	fs.IntVar(&c.RandomOutputLen, "random-output-len", c.RandomOutputLen, "output tokens per request")
	fs.Float64Var(&c.RandomRangeRatio, "random-range-ratio", c.RandomRangeRatio, "range ratio r in [0, 1): lengths drawn uniformly from [len*(1-r), len*(1+r)]")
	fs.IntVar(&c.RandomPrefixLen, "random-prefix-len", c.RandomPrefixLen, "tokens of a fixed prefix before the random part of every prompt")
	fs.IntVar(&c.PrefixRepetitionPrefixLen, "prefix-repetition-prefix-len", c.PrefixRepetitionPrefixLen, "prefix_repetition: tokens of each shared prefix")
	fs.IntVar(&c.PrefixRepetitionSuffixLen, "prefix-repetition-suffix-len", c.PrefixRepetitionSuffixLen, "prefix_repetition: tokens after the prefix, different for each request")
	fs.IntVar(&c.PrefixRepetitionNumPrefixes, "prefix-repetition-num-prefixes", c.PrefixRepetitionNumPrefixes, "prefix_repetition: number of prefixes; each request uses one")
	fs.IntVar(&c.PrefixRepetitionOutputLen, "prefix-repetition-output-len", c.PrefixRepetitionOutputLen, "prefix_repetition: output tokens per request")
	fs.IntVar(&c.MultiTurnTurns, "multi-turn-turns", c.MultiTurnTurns, "multi_turn: user turns per conversation")
	fs.IntVar(&c.MultiTurnCommonPrefixLen, "multi-turn-common-prefix-len", c.MultiTurnCommonPrefixLen, "multi_turn: tokens every conversation's first message starts with")
	fs.IntVar(&c.MultiTurnPrefixLen, "multi-turn-prefix-len", c.MultiTurnPrefixLen, "multi_turn: tokens of a conversation's own prefix in its first message")
	fs.IntVar(&c.MultiTurnUserLen, "multi-turn-user-len", c.MultiTurnUserLen, "multi_turn: tokens of each user message")
	fs.IntVar(&c.MultiTurnOutputLen, "multi-turn-output-len", c.MultiTurnOutputLen, "multi_turn: output tokens of each answer")
	fs.Float64Var(&c.MultiTurnThinkTime, "multi-turn-think-time", c.MultiTurnThinkTime, "multi_turn: seconds between an answer and the next turn")
	fs.StringVar(&c.Tenants, "tenants", c.Tenants, "tenant mix name:weight,... (as a:9,b:1): each request's \"user\"; figures per tenant follow the result block")
	fs.StringVar(&c.Priorities, "priorities", c.Priorities, "priority mix priority:weight,... (as 0:1,1:9): each request's vLLM \"priority\" (lower first); figures per priority follow the result block")
	fs.IntVar(&c.InputLen, "input-len", c.InputLen, "input tokens per request: the dataset's (--random-input-len), when set")
	fs.IntVar(&c.OutputLen, "output-len", c.OutputLen, "output tokens per request: the dataset's (--random-output-len), when set")
	fs.IntVar(&c.NumPrompts, "num-prompts", c.NumPrompts, "number of prompts to process")
	fs.IntVar(&c.NumWarmups, "num-warmups", c.NumWarmups, "warmup requests to run before the measured ones (not counted)")
	fs.IntVar(&c.ReadyCheckTimeoutSec, "ready-check-timeout-sec", c.ReadyCheckTimeoutSec, "seconds to wait for the initial test request to succeed, trying every 5 s; 0 skips the test run")
	fs.StringVar(&c.Tokenizer, "tokenizer", c.Tokenizer, "tokenizer name or path: accepted, but none is loaded (prompts are words; output tokens are the server's usage)")
	fs.Float64Var(&c.RequestRate, "request-rate", c.RequestRate, "requests per second; inf sends all at time 0, else a Poisson process or gamma distribution (see --burstiness)")
	fs.Float64Var(&c.Burstiness, "burstiness", c.Burstiness, "burstiness factor: 1 is a Poisson process, below 1 burstier, above 1 more uniform (inf: constant gaps)")
	fs.Func("max-concurrency", "maximum number of requests in flight (default: no limit)", func(s string) error {
		n, err := strconv.Atoi(s)
		if err != nil {
			return err
		}
		if n <= 0 {
			return errors.New("--max-concurrency must be greater than 0")
		}
		c.MaxConcurrency = n
		return nil
	})
	// vLLM's main_async sets ignore_eos for the random dataset on every
	// OpenAI-compatible backend, so every pdq bench request carries it:
	// the flag is taken, and changes nothing.
	fs.Bool("ignore-eos", false, "send ignore_eos (vLLM, and so pdq bench, sends it anyway for the random dataset)")
	fs.StringVar(&c.PercentileMetrics, "percentile-metrics", c.PercentileMetrics, "comma-separated metrics to report: "+strings.Join(percentileMetricNames, ", "))
	fs.StringVar(&c.MetricPercentiles, "metric-percentiles", c.MetricPercentiles, "comma-separated percentiles to report, e.g. 25,50,75")
	fs.Int64Var(&c.Seed, "seed", c.Seed, "seed of the dataset and of the arrival times")
	fs.Func("goodput", "service level objectives KEY:VALUE in ms, space-separated (ttft, tpot, e2el); enables Request goodput", func(s string) error {
		c.Goodput = append(c.Goodput, strings.Fields(s)...)
		return nil
	})
	fs.BoolVar(&c.SaveResult, "save-result", c.SaveResult, "save the result to a JSON file")
	fs.BoolVar(&c.SaveDetailed, "save-detailed", c.SaveDetailed, "with --save-result: also save per-request lengths, times, texts and errors")
	fs.StringVar(&c.ResultDir, "result-dir", c.ResultDir, "directory of the result file (default: the current directory)")
	fs.StringVar(&c.ResultFilename, "result-filename", c.ResultFilename, "result file name (default {label}-{request_rate}qps[-concurrency{n}]-{model}-{date}.json)")
	fs.StringVar(&c.Label, "label", c.Label, "label (prefix) of the result file (default: --backend)")
	fs.BoolVar(&c.DisableTQDM, "disable-tqdm", c.DisableTQDM, "no progress bar (there is none when stderr is not a terminal)")
	fs.StringVar(&c.RequestIDPrefix, "request-id-prefix", c.RequestIDPrefix, "prefix of the X-Request-Id of every request (default bench-<8 random hex digits>-)")
	fs.StringVar(&c.PDPrefill, "pd-prefill", c.PDPrefill, "prefill engine base URL: drive each request's prefill leg there and its decode leg at the base URL, as vLLM's toy P/D proxy")
}

// nargsFlags are the flags that take several values in vLLM.
var nargsFlags = []string{"goodput"}

// JoinNargs rewrites args so that a flag which takes several values in
// vLLM (--goodput ttft:500 tpot:50) takes the words after it, up to the
// next flag, as one space-separated value, which Go's flag package can
// parse.
func JoinNargs(args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(out, args[i:]...)
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || !slices.Contains(nargsFlags, name) {
			out = append(out, a)
			continue
		}
		var vals []string
		if hasValue {
			vals = append(vals, value)
		}
		for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			i++
			vals = append(vals, args[i])
		}
		out = append(out, "--"+name+"="+strings.Join(vals, " "))
	}
	return out
}

// settings are a Config's parsed and checked values.
type settings struct {
	baseURL, apiURL, prefillURL string
	chat                        bool
	percentileMetrics           []string
	percentiles                 []float64
	goodput                     Goodput
	tenants, priorities         Mix
}

// check validates c and works out its derived values.
func (c *Config) check() (settings, error) {
	var s settings
	bad := func(format string, a ...any) (settings, error) {
		return settings{}, fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, a...)...)
	}
	switch c.Backend {
	case "openai", "vllm":
	case "openai-chat":
		s.chat = true
	default:
		return bad("--backend must be openai or openai-chat, got %q", c.Backend)
	}
	switch c.DatasetName {
	case "random", "prefix_repetition":
	case "multi_turn":
		if !s.chat {
			return bad("--dataset-name multi_turn needs --backend openai-chat: a conversation is chat messages")
		}
		if !(c.MultiTurnThinkTime >= 0) {
			return bad("--multi-turn-think-time must not be negative, got %v", c.MultiTurnThinkTime)
		}
	default:
		return bad("--dataset-name must be random, prefix_repetition or multi_turn, got %q", c.DatasetName)
	}
	var err error
	if s.tenants, err = ParseMix("--tenants", c.Tenants); err != nil {
		return settings{}, err
	}
	if s.priorities, err = ParseMix("--priorities", c.Priorities); err != nil {
		return settings{}, err
	}
	for _, p := range s.priorities.Names {
		if _, err := strconv.Atoi(p); err != nil {
			return bad("--priorities: %q is not an integer priority", p)
		}
	}
	if c.InputLen < 0 || c.OutputLen < 0 || c.NumWarmups < 0 || c.ReadyCheckTimeoutSec < 0 {
		return bad("--input-len, --output-len, --num-warmups and --ready-check-timeout-sec must not be negative")
	}
	if c.InputLen > 0 {
		c.RandomInputLen = c.InputLen
	}
	if c.OutputLen > 0 {
		c.RandomOutputLen = c.OutputLen
	}
	if c.NumPrompts <= 0 {
		return bad("--num-prompts must be positive, got %d", c.NumPrompts)
	}
	if !(c.RequestRate > 0) {
		return bad("--request-rate must be positive, got %v", c.RequestRate)
	}
	if !(c.Burstiness > 0) {
		return bad("--burstiness must be positive, got %v", c.Burstiness)
	}
	if c.MaxConcurrency < 0 {
		return bad("--max-concurrency must be greater than 0")
	}
	if c.Seed < 0 || c.Seed > math.MaxUint32 {
		return bad("--seed must be between 0 and 2**32 - 1, got %d", c.Seed)
	}
	endpoint := c.Endpoint
	if endpoint == "" {
		endpoint = "/v1/completions"
		if s.chat {
			endpoint = "/v1/chat/completions"
		}
	}
	if s.chat && !strings.HasSuffix(endpoint, "chat/completions") {
		return bad("OpenAI Chat Completions API URL must end with chat/completions, got --endpoint %s", endpoint)
	}
	if !s.chat && !strings.HasSuffix(endpoint, "completions") {
		return bad("OpenAI Completions API URL must end with completions, got --endpoint %s", endpoint)
	}
	if c.BaseURL != "" {
		s.baseURL = strings.TrimSuffix(c.BaseURL, "/")
	} else {
		s.baseURL = "http://" + net.JoinHostPort(c.Host, strconv.Itoa(c.Port))
	}
	s.apiURL = s.baseURL + endpoint
	if c.PDPrefill != "" {
		s.prefillURL = strings.TrimSuffix(c.PDPrefill, "/") + endpoint
	}
	for _, name := range strings.Split(c.PercentileMetrics, ",") {
		if !slices.Contains(percentileMetricNames, name) {
			return bad("--percentile-metrics: unknown metric %q (have %s)", name, strings.Join(percentileMetricNames, ", "))
		}
		s.percentileMetrics = append(s.percentileMetrics, name)
	}
	for _, p := range strings.Split(c.MetricPercentiles, ",") {
		f, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || !(f >= 0 && f <= 100) {
			return bad("--metric-percentiles: %q is not a percentile in [0, 100]", p)
		}
		s.percentiles = append(s.percentiles, f)
	}
	for _, pair := range c.Goodput {
		name, value, ok := strings.Cut(pair, ":")
		f, err := strconv.ParseFloat(value, 64)
		if !ok || strings.Contains(value, ":") || err != nil {
			return bad(`--goodput: specify service level objectives as "KEY:VALUE" pairs, where the key is a metric name and the value a number in milliseconds; got %q`, pair)
		}
		if f < 0 {
			return bad("--goodput: %s: %v: the service level objective value should be non-negative", name, f)
		}
		switch name {
		case "ttft":
			s.goodput.TTFT = &f
		case "tpot":
			s.goodput.TPOT = &f
		case "e2el":
			s.goodput.E2EL = &f
		default:
			return bad("--goodput: invalid metric name %q: the service level objective name should be one of ttft, tpot, e2el", name)
		}
	}
	return s, nil
}
