package simconfig

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/pkg/sim/sched"
)

// Protocol is the NIXL connector protocol the engine speaks.
type Protocol string

const (
	// ProtocolV1 names a prefill's blocks by the decode engine's own internal
	// request id, as vLLM did before remote_request_id existed: the two legs
	// must carry the same X-Request-Id. A read of an id the prefill engine
	// does not hold (another X-Request-Id, or an expired lease) kills the
	// decode engine, as the KeyError in vLLM's scheduler did.
	ProtocolV1 Protocol = "v1"
	// ProtocolV2 names them by the remote_request_id the prefill returned.
	ProtocolV2 Protocol = "v2"
)

// LoadFailurePolicy is what a decode engine does when it cannot load a
// prefill's KV blocks (vLLM's kv_load_failure_policy).
type LoadFailurePolicy string

const (
	// LoadFailureFail fails the request (vLLM's default since Feb 2026).
	LoadFailureFail LoadFailurePolicy = "fail"
	// LoadFailureRecompute prefills the prompt locally instead.
	LoadFailureRecompute LoadFailurePolicy = "recompute"
)

// Runner is the kind of model the engine runs, as vLLM's --runner.
type Runner string

// The runners. RunnerAuto is read as RunnerGenerate.
const (
	RunnerAuto     Runner = "auto"
	RunnerGenerate Runner = "generate"
	RunnerPooling  Runner = "pooling"
)

// LoRAModule is one --lora-modules entry: an adapter name, the path it is
// loaded from, and optionally the served base model it applies to.
type LoRAModule struct {
	Name          string `json:"name"`
	Path          string `json:"path"`
	BaseModelName string `json:"base_model_name,omitempty"`
}

// ParseLoRAModule reads a --lora-modules value as vLLM does: "name=path",
// or a JSON object {"name":..,"path":..,"base_model_name":..}.
func ParseLoRAModule(s string) (LoRAModule, error) {
	if name, path, ok := strings.Cut(s, "="); ok && !strings.Contains(s, ",") {
		return LoRAModule{Name: name, Path: path}, nil
	}
	var m LoRAModule
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return LoRAModule{}, fmt.Errorf("invalid --lora-modules %q: want name=path or a JSON object with name, path and optionally base_model_name: %v", s, err)
	}
	return m, nil
}

// Config configures a simulated engine. The zero value is not usable; start
// from [DefaultConfig].
type Config struct {
	// Addr is the HTTP listen address.
	Addr string
	// Model is the model the engine runs, vLLM's --model: the root of its
	// /v1/models cards, and its served name unless ServedModelNames is set.
	Model string
	// ServedModelNames are the names the base model answers to (vLLM's
	// --served-model-name); responses carry the first. Empty: Model.
	ServedModelNames []string
	// LoRAModules are the adapters loaded at start (vLLM's --lora-modules).
	LoRAModules []LoRAModule
	// RuntimeLoRA serves POST /v1/load_lora_adapter and
	// /v1/unload_lora_adapter, as vLLM does with
	// VLLM_ALLOW_RUNTIME_LORA_UPDATING=true.
	RuntimeLoRA bool
	// MMTokens is the number of prompt tokens each image, audio or video
	// part of a chat message counts for.
	MMTokens int
	// Runner is vLLM's --runner: generate (chat and completions) or
	// pooling (embeddings).
	Runner Runner
	// EmbeddingDim is the length of the vectors a pooling engine returns.
	EmbeddingDim int
	// Version is what GET /version reports.
	Version string
	// Seed varies the generated text.
	Seed uint64
	// MaxModelLen bounds prompt plus output tokens, as vLLM's --max-model-len.
	MaxModelLen int
	// LegacyLengthErrors words length refusals as vLLM before 0.10 did:
	// "you requested N tokens (P in the messages, M in the completion)".
	LegacyLengthErrors bool
	// APIKey, when set, is required as a bearer token on /v1 (vLLM's --api-key).
	APIKey string
	// EngineID is the NIXL engine id; empty picks a random one, as vLLM does.
	EngineID string

	// KVHost is the side channel's bind address and the remote_host it
	// advertises, as vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST (default localhost).
	KVHost string
	// KVPort is the side channel's port (VLLM_NIXL_SIDE_CHANNEL_PORT); 0 picks
	// a free one.
	KVPort int
	// BlockSize is the number of tokens per KV block.
	BlockSize int
	// KVLease is how long a prefill holds blocks that no decode engine reads.
	KVLease time.Duration
	// KVHeartbeat is how often a decode engine extends the lease of a
	// request that waits for a slot.
	KVHeartbeat time.Duration
	// Protocol is the NIXL protocol: v1 or v2.
	Protocol Protocol
	// KVLoadFailure is the policy on a failed KV load: fail or recompute.
	KVLoadFailure LoadFailurePolicy

	// PrefillOverhead and PrefillPerToken give the time to prefill a prompt.
	PrefillOverhead time.Duration
	PrefillPerToken time.Duration
	// KVTransferPerBlock is the time to read one block from a prefill engine.
	KVTransferPerBlock time.Duration
	// ITL is the time between output tokens.
	ITL time.Duration
	// MaxNumSeqs is the number of requests that run at once; more wait.
	MaxNumSeqs int

	// Fault is the fault injected from the start; POST /sim/faults changes it.
	Fault Fault

	// Profile, when set, names a calibrated engine (sched.Profiles) and
	// runs requests through vLLM's scheduler in steps, with continuous
	// batching, KV capacity and prefix caching, instead of the fixed
	// latencies above (PrefillOverhead, PrefillPerToken, ITL,
	// KVTransferPerBlock), which it replaces.
	Profile string
	// TimeScale multiplies the profile's costs: 0.1 runs ten times faster.
	TimeScale float64
	// NumGPUBlocks overrides the profile's KV capacity in blocks (vLLM's
	// --num-gpu-blocks-override); 0 keeps it.
	NumGPUBlocks int
	// MaxNumBatchedTokens overrides the profile's token budget of a step;
	// 0 keeps it.
	MaxNumBatchedTokens int
	// NoPrefixCaching turns automatic prefix caching off (vLLM's
	// --no-enable-prefix-caching).
	NoPrefixCaching bool
	// SchedulingPolicy is vLLM's --scheduling-policy: fcfs or priority. A
	// request with a priority other than 0 is refused under fcfs, as vLLM
	// refuses it.
	SchedulingPolicy sched.Policy
	// PromptTokensDetails reports usage.prompt_tokens_details.cached_tokens
	// when some prompt tokens were not computed (vLLM's
	// --enable-prompt-tokens-details).
	PromptTokensDetails bool
}

// Batched says requests run through the scheduler model.
func (c Config) Batched() bool { return c.Profile != "" }

// Sched is the scheduler of a batched engine: the profile with the
// overrides, its costs scaled, and the cost of a KV read per block and
// per read.
func (c Config) Sched() (cfg sched.Config, perBlock, perRead time.Duration) {
	p := sched.Profiles()[c.Profile]
	cfg = p.Config
	cfg.BlockSize, cfg.MaxNumSeqs, cfg.Policy = c.BlockSize, c.MaxNumSeqs, c.SchedulingPolicy
	cfg.PrefixCaching = !c.NoPrefixCaching
	if c.NumGPUBlocks > 0 {
		cfg.NumBlocks = c.NumGPUBlocks
	}
	if c.MaxNumBatchedTokens > 0 {
		cfg.MaxNumBatchedTokens = c.MaxNumBatchedTokens
	}
	scale := func(d time.Duration) time.Duration { return time.Duration(float64(d) * c.TimeScale) }
	cfg.Cost = sched.Cost{Base: scale(cfg.Cost.Base), PerPrefillToken: scale(cfg.Cost.PerPrefillToken),
		PerDecodeSeq: scale(cfg.Cost.PerDecodeSeq), PerContextToken: scale(cfg.Cost.PerContextToken)}
	return cfg, scale(p.TransferPerBlock), scale(p.TransferBase)
}

// DefaultConfig returns the defaults: small, realistic latencies for an
// 8B-class model on one GPU, and vLLM's defaults where vLLM has one.
func DefaultConfig() Config {
	return Config{
		Addr:               "127.0.0.1:8100",
		Model:              "pdq-sim",
		RuntimeLoRA:        true,
		MMTokens:           16,
		Runner:             RunnerGenerate,
		EmbeddingDim:       384,
		Version:            "0.14.0",
		Seed:               1,
		MaxModelLen:        8192,
		KVHost:             "localhost",
		KVPort:             5600,
		BlockSize:          16,
		KVLease:            30 * time.Second,
		KVHeartbeat:        5 * time.Second,
		Protocol:           ProtocolV2,
		KVLoadFailure:      LoadFailureFail,
		PrefillOverhead:    10 * time.Millisecond,
		PrefillPerToken:    50 * time.Microsecond,
		KVTransferPerBlock: 100 * time.Microsecond,
		ITL:                10 * time.Millisecond,
		MaxNumSeqs:         256,
		Fault:              Fault{Delay: Duration(2 * time.Second)},
		TimeScale:          1,
		SchedulingPolicy:   sched.FCFS,
	}
}

// RegisterFlags binds the configuration to command-line flags, with the
// current values as defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Addr, "addr", c.Addr, "HTTP listen address")
	fs.StringVar(&c.Model, "model", c.Model, "model the engine runs: the root of its /v1/models cards, and its name unless --served-model-name is set")
	fs.Func("served-model-name", "name the model answers to; comma-separated or repeated for several, responses carry the first (default: --model)", func(s string) error {
		for _, name := range strings.Split(s, ",") {
			if name = strings.TrimSpace(name); name != "" {
				c.ServedModelNames = append(c.ServedModelNames, name)
			}
		}
		return nil
	})
	fs.Func("lora-modules", "LoRA adapter loaded at start, name=path or JSON {\"name\":..,\"path\":..,\"base_model_name\":..}; repeat for several", func(s string) error {
		m, err := ParseLoRAModule(s)
		if err != nil {
			return err
		}
		c.LoRAModules = append(c.LoRAModules, m)
		return nil
	})
	fs.BoolVar(&c.RuntimeLoRA, "allow-runtime-lora-updating", c.RuntimeLoRA, "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
	fs.IntVar(&c.MMTokens, "mm-tokens", c.MMTokens, "prompt tokens per image, audio or video part of a chat message")
	fs.Func("runner", "model runner: generate (chat, completions) or pooling (embeddings) (default generate)", func(s string) error {
		c.Runner = Runner(s)
		return nil
	})
	fs.IntVar(&c.EmbeddingDim, "embedding-dim", c.EmbeddingDim, "length of the embedding vectors of --runner pooling")
	fs.StringVar(&c.Version, "vllm-version", c.Version, "version GET /version reports")
	fs.Uint64Var(&c.Seed, "seed", c.Seed, "seed of the generated text")
	fs.IntVar(&c.MaxModelLen, "max-model-len", c.MaxModelLen, "maximum prompt plus output tokens")
	fs.BoolVar(&c.LegacyLengthErrors, "legacy-length-errors", c.LegacyLengthErrors, "word length refusals as vLLM before 0.10 (\"P in the messages, M in the completion\")")
	fs.StringVar(&c.APIKey, "api-key", c.APIKey, "bearer token required on /v1 (empty: none)")
	fs.StringVar(&c.EngineID, "engine-id", c.EngineID, "NIXL engine id (empty: random)")
	fs.StringVar(&c.KVHost, "kv-host", c.KVHost, "side-channel host: bound, and advertised as remote_host")
	fs.IntVar(&c.KVPort, "kv-port", c.KVPort, "side-channel port (0: any free port)")
	fs.IntVar(&c.BlockSize, "block-size", c.BlockSize, "tokens per KV block")
	fs.DurationVar(&c.KVLease, "kv-lease", c.KVLease, "how long unread prefill blocks stay held")
	fs.DurationVar(&c.KVHeartbeat, "kv-heartbeat", c.KVHeartbeat, "lease heartbeat of a decode request waiting for a slot")
	fs.Func("nixl-protocol", "NIXL protocol: v1 (blocks named by the decode's own request id) or v2 (by remote_request_id) (default v2)", func(s string) error {
		c.Protocol = Protocol(s)
		return nil
	})
	fs.Func("kv-load-failure", "on a failed KV load: fail or recompute (default fail)", func(s string) error {
		c.KVLoadFailure = LoadFailurePolicy(s)
		return nil
	})
	fs.DurationVar(&c.PrefillOverhead, "prefill-overhead", c.PrefillOverhead, "fixed time of a prefill")
	fs.DurationVar(&c.PrefillPerToken, "prefill-per-token", c.PrefillPerToken, "prefill time per prompt token")
	fs.DurationVar(&c.KVTransferPerBlock, "kv-transfer-per-block", c.KVTransferPerBlock, "time to read one KV block from a prefill engine")
	fs.DurationVar(&c.ITL, "itl", c.ITL, "time between output tokens")
	fs.IntVar(&c.MaxNumSeqs, "max-num-seqs", c.MaxNumSeqs, "requests running at once; more wait in a queue")
	fs.Float64Var(&c.Fault.Rate, "fault-rate", c.Fault.Rate, "share of requests, 0 to 1, that get --fault-kind")
	fs.Func("fault-kind", "fault to inject: "+faultKindList(), func(s string) error {
		c.Fault.Kind = FaultKind(s)
		return nil
	})
	fs.Func("fault-delay", "how late the first byte comes with --fault-kind slow, and the answer with late (default 2s)", func(s string) error {
		return c.Fault.Delay.Set(s)
	})
	fs.StringVar(&c.Profile, "profile", c.Profile, "calibrated engine to model with vLLM's scheduler: "+profileList()+" (empty: fixed latencies)")
	fs.Float64Var(&c.TimeScale, "time-scale", c.TimeScale, "multiplies the profile's step and transfer costs: 0.1 runs ten times faster")
	fs.IntVar(&c.NumGPUBlocks, "num-gpu-blocks-override", c.NumGPUBlocks, "KV capacity in blocks, with --profile (0: the profile's)")
	fs.IntVar(&c.MaxNumBatchedTokens, "max-num-batched-tokens", c.MaxNumBatchedTokens, "token budget of a step, with --profile (0: the profile's)")
	fs.BoolVar(&c.NoPrefixCaching, "no-enable-prefix-caching", c.NoPrefixCaching, "turn automatic prefix caching off, with --profile")
	fs.Func("scheduling-policy", "order of waiting requests: fcfs or priority (default fcfs); priority other than 0 needs priority", func(s string) error {
		c.SchedulingPolicy = sched.Policy(s)
		return nil
	})
	fs.BoolVar(&c.PromptTokensDetails, "enable-prompt-tokens-details", c.PromptTokensDetails, "report usage.prompt_tokens_details.cached_tokens")
}

func profileList() string {
	var names []string
	for name := range sched.Profiles() {
		names = append(names, name)
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

// ServedNames are the names the base model answers to.
func (c Config) ServedNames() []string {
	if len(c.ServedModelNames) > 0 {
		return c.ServedModelNames
	}
	return []string{c.Model}
}

// Validate reports every bad value at once.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Model == "" {
		bad("model must not be empty")
	}
	for _, name := range c.ServedModelNames {
		if strings.TrimSpace(name) == "" {
			bad("served-model-name must not be empty")
		}
	}
	loras := map[string]bool{}
	for _, m := range c.LoRAModules {
		switch {
		case m.Name == "" || m.Path == "":
			bad("lora-modules %q: both a name and a path are required", m.Name+"="+m.Path)
		case loras[m.Name]:
			// vLLM fails at start the same way.
			bad("lora-modules: The lora adapter '%s' has already been loaded.", m.Name)
		}
		loras[m.Name] = true
	}
	if c.MMTokens < 1 {
		bad("mm-tokens must be at least 1, got %d", c.MMTokens)
	}
	switch c.Runner {
	case RunnerAuto, RunnerGenerate, RunnerPooling:
	default:
		bad("runner must be auto, generate or pooling, got %q", c.Runner)
	}
	if c.EmbeddingDim < 1 {
		bad("embedding-dim must be at least 1, got %d", c.EmbeddingDim)
	}
	if c.MaxModelLen < 2 {
		bad("max-model-len must be at least 2, got %d", c.MaxModelLen)
	}
	if c.KVPort < 0 || c.KVPort > 65535 {
		bad("kv-port %d is out of range", c.KVPort)
	}
	if c.BlockSize < 1 {
		bad("block-size must be at least 1, got %d", c.BlockSize)
	}
	if c.KVLease <= 0 {
		bad("kv-lease must be positive, got %v", c.KVLease)
	}
	if c.KVHeartbeat <= 0 {
		bad("kv-heartbeat must be positive, got %v", c.KVHeartbeat)
	}
	if c.Protocol != ProtocolV1 && c.Protocol != ProtocolV2 {
		bad("nixl-protocol must be v1 or v2, got %q", c.Protocol)
	}
	if c.KVLoadFailure != LoadFailureFail && c.KVLoadFailure != LoadFailureRecompute {
		bad("kv-load-failure must be fail or recompute, got %q", c.KVLoadFailure)
	}
	for name, d := range map[string]time.Duration{
		"prefill-overhead": c.PrefillOverhead, "prefill-per-token": c.PrefillPerToken,
		"kv-transfer-per-block": c.KVTransferPerBlock, "itl": c.ITL,
	} {
		if d < 0 {
			bad("%s must not be negative, got %v", name, d)
		}
	}
	if c.MaxNumSeqs < 1 {
		bad("max-num-seqs must be at least 1, got %d", c.MaxNumSeqs)
	}
	if err := c.Fault.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.SchedulingPolicy != sched.FCFS && c.SchedulingPolicy != sched.Priority {
		bad("scheduling-policy must be fcfs or priority, got %q", c.SchedulingPolicy)
	}
	if c.Profile != "" {
		if _, ok := sched.Profiles()[c.Profile]; !ok {
			bad("unknown profile %q (want one of %s)", c.Profile, profileList())
		} else if cfg, _, _ := c.Sched(); c.TimeScale > 0 {
			if err := cfg.Validate(); err != nil {
				errs = append(errs, err)
			} else if room := cfg.NumBlocks * cfg.BlockSize; c.MaxModelLen > room {
				// vLLM refuses to start so (vllm/v1/core/kv_cache_utils.py).
				bad("The model's max seq len (%d) is larger than the maximum number of tokens that can be stored in KV cache (%d). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.", c.MaxModelLen, room)
			}
		}
	}
	if c.TimeScale <= 0 {
		bad("time-scale must be positive, got %v", c.TimeScale)
	}
	if c.NumGPUBlocks < 0 || c.MaxNumBatchedTokens < 0 {
		bad("num-gpu-blocks-override and max-num-batched-tokens must not be negative")
	}
	return errors.Join(errs...)
}

// Duration is a time.Duration that reads and writes JSON as "1.5s", and also
// reads a number of milliseconds.
type Duration time.Duration

// Set parses a Go duration string.
func (d *Duration) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// String formats the duration as Go does.
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalJSON writes the duration as a string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// UnmarshalJSON reads "1.5s" or a number of milliseconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		return d.Set(s)
	}
	var ms float64
	if err := json.Unmarshal(b, &ms); err != nil {
		return errors.New(`duration must be a string like "1.5s" or a number of milliseconds`)
	}
	*d = Duration(ms * float64(time.Millisecond))
	return nil
}
