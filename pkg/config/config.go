// Package config reads the configuration of pdq's services from the
// environment. Every name carries the PDQ_ prefix; the names are a contract
// shared with the docs and tests (see architecture.md). One-shot tools take
// flags instead.
package config

import (
	"errors"
	"fmt"
	"math"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"

	"github.com/pdq-dev/pdq/pkg/logging"
)

// Log is the logging configuration every command shares.
type Log struct {
	// Level is debug, info, warn or error (PDQ_LOG_LEVEL).
	Level string `envconfig:"PDQ_LOG_LEVEL" default:"info"`
	// Format is text (tint) or json; empty picks text on a terminal and JSON
	// otherwise (PDQ_LOG_FORMAT).
	Format string `envconfig:"PDQ_LOG_FORMAT"`
}

// Config is the configuration of pdq's services.
type Config struct {
	Log

	// NATSURL is the NATS server to join; empty in `pdq up` starts an
	// embedded one.
	NATSURL string `envconfig:"PDQ_NATS_URL"`
	// NATSListen is where the embedded server also listens for other
	// processes: by default NATS's own port on loopback, where the tools
	// look for it with no settings; empty (PDQ_NATS_LISTEN=) means
	// in-process only. NATSListenSet says it was set, rather than the
	// default: only the default gives way to a free port when taken.
	NATSListen    string `envconfig:"PDQ_NATS_LISTEN" default:"127.0.0.1:4222"`
	NATSListenSet bool   `ignored:"true"`
	// DataDir holds the embedded server's JetStream store.
	DataDir string `envconfig:"PDQ_DATA_DIR" default:"./data"`
	// HTTPAddr is the gateway's listen address.
	HTTPAddr string `envconfig:"PDQ_HTTP_ADDR" default:":8000"`

	// PrefillEngines and DecodeEngines are engine base URLs for `pdq up`.
	PrefillEngines []string `envconfig:"PDQ_PREFILL_ENGINES"`
	DecodeEngines  []string `envconfig:"PDQ_DECODE_ENGINES"`
	// EngineURL is the engine of a single `pdq prefill` or `pdq decode`.
	EngineURL string `envconfig:"PDQ_ENGINE_URL"`
	// EngineAPIKey is sent as a bearer token on every engine call, for
	// engines started with vLLM's --api-key.
	EngineAPIKey string `envconfig:"PDQ_ENGINE_API_KEY"`
	// EngineSlots is the number of requests a worker runs on its engine at
	// once; 0 picks the role's default.
	EngineSlots int `envconfig:"PDQ_ENGINE_SLOTS"`
	// KVHost is advertised as remote_host when a prefill engine reports a
	// loopback or unspecified one.
	KVHost string `envconfig:"PDQ_KV_HOST"`

	// MetricsAddr is where a lone worker (pdq prefill, pdq decode) serves
	// /metrics; empty serves none. The gateway serves /metrics on its own
	// address, for itself and for pdq up's workers.
	MetricsAddr string `envconfig:"PDQ_METRICS_ADDR"`

	// APIKeys, when set, are the bearer tokens the gateway accepts; each
	// reads the records of its own requests only.
	APIKeys []string `envconfig:"PDQ_API_KEYS"`
	// OperatorKeys are bearer tokens the gateway accepts too, that read
	// every request's record.
	OperatorKeys []string `envconfig:"PDQ_OPERATOR_KEYS"`
	// DisaggMinPromptTokens is the P/D threshold: prompts estimated shorter
	// skip prefill and are prefilled by the decode engine; 0 sends every
	// request through prefill.
	DisaggMinPromptTokens int `envconfig:"PDQ_DISAGG_MIN_PROMPT_TOKENS" default:"16"`

	// RequestTimeout is every request's deadline: work on a request stops
	// when it passes, wherever the request is.
	RequestTimeout time.Duration `envconfig:"PDQ_REQUEST_TIMEOUT" default:"10m"`
	// KVTTL is how old a handoff may be when a decode worker pulls it;
	// older ones are prefilled again. Keep it under the engines' KV lease
	// (vLLM: 30 s).
	KVTTL time.Duration `envconfig:"PDQ_KV_TTL" default:"25s"`
	// AckWait is how long a job may go without a sign of life from its
	// worker before another worker gets it: a crashed worker's jobs move on
	// after this long. Running jobs signal every third of it.
	AckWait time.Duration `envconfig:"PDQ_ACK_WAIT" default:"30s"`
	// MaxGenerations bounds how many times one request's prefill may start.
	MaxGenerations int `envconfig:"PDQ_MAX_GENERATIONS" default:"3"`
	// MaxQueue bounds the jobs waiting in each pool's prefill or decode
	// queue; past it the gateway answers 429.
	MaxQueue int `envconfig:"PDQ_MAX_QUEUE" default:"1024"`
	// BodyTimeout bounds the read of a request body: a client that stops
	// sending it gets a 408.
	BodyTimeout time.Duration `envconfig:"PDQ_BODY_TIMEOUT" default:"30s"`
	// MaxInflightBytes bounds the request bodies the gateway holds at once.
	MaxInflightBytes int64 `envconfig:"PDQ_MAX_INFLIGHT_BYTES" default:"536870912"`
	// MaxDeliver is how many deliveries of one job a stage runs before the
	// job fails for good (a crashed worker's job is delivered again).
	MaxDeliver int `envconfig:"PDQ_MAX_DELIVER" default:"4"`

	// PrefillTimeout bounds a prefill engine's answer; past it the attempt
	// fails as retryable and the job goes to another engine.
	PrefillTimeout time.Duration `envconfig:"PDQ_PREFILL_TIMEOUT" default:"60s"`
	// StallTimeout bounds the silence of a decode: the engine's time to its
	// first chunk and between chunks, and the gateway's wait for a running
	// decode's heartbeats.
	StallTimeout time.Duration `envconfig:"PDQ_STALL_TIMEOUT" default:"30s"`
	// PrefillFallback is what the gateway does with a long prompt when its
	// pool has no healthy prefill worker: decode (the decode engine
	// prefills it itself) or fail (503).
	PrefillFallback string `envconfig:"PDQ_PREFILL_FALLBACK" default:"decode"`
	// Affinity routes each prefill to the engine whose prefix cache likely
	// holds its prompt's start (docs/scheduling.md): the gateway prefers
	// an engine, that engine's worker takes the job first, and any other
	// takes it when that one has no room or is gone. Off: any worker.
	Affinity bool `envconfig:"PDQ_AFFINITY" default:"true"`
	// FairQueue holds the requests a pool cannot start yet in the gateway,
	// letting them in by priority, then by tenant in proportion to their
	// weights (docs/scheduling.md); a tenant over its share of PDQ_MAX_QUEUE
	// is refused. Off: requests queue in JetStream, first come first served.
	FairQueue bool `envconfig:"PDQ_FAIR_QUEUE" default:"true"`
	// FairLimit is what the fair queue lets a pool hold before it queues
	// requests in the gateway: slots (its workers' slots, a request
	// holding one for its whole life) or engines (one request an engine of
	// the first stage until it frees the engine, more while their uncached
	// prompts are small; docs/scheduling.md). engines orders the work
	// before the engines, which makes tenants and priorities fair under
	// overload, but holds each engine to about one prompt at a time (two
	// while the work is of one tenant and one priority): it
	// suits engines whose prefill time grows with the tokens they
	// schedule, not engines that run many prefills in the time of one.
	FairLimit string `envconfig:"PDQ_FAIR_LIMIT" default:"slots"`
	// TenantWeights are the tenants' weights in the fair queue, as
	// "name:weight,name:weight"; a tenant not named weighs 1. A tenant is
	// the request's API key (its owner, as records show it) when the
	// gateway takes keys, else the body's "user".
	TenantWeights map[string]float64 `envconfig:"PDQ_TENANT_WEIGHTS"`
	// MigrationLimit bounds how many times one request's decode moves to
	// another engine after output was sent; 0 ends such a stream with an
	// error.
	MigrationLimit int `envconfig:"PDQ_MIGRATION_LIMIT" default:"1"`
	// ShutdownGrace is how long running requests may finish after SIGTERM
	// (streams longer than that are cut); keep the orchestrator's own
	// grace, Kubernetes' terminationGracePeriodSeconds, above it.
	ShutdownGrace time.Duration `envconfig:"PDQ_SHUTDOWN_GRACE" default:"30s"`
	// BreakerFailures is how many consecutive transport errors, 5xx or
	// time-outs open a worker's circuit breaker on its engine.
	BreakerFailures int `envconfig:"PDQ_BREAKER_FAILURES" default:"3"`

	// NATS holds the NATS connection's credentials and stream replicas,
	// PDQ_NATS_*, read on their own (see Load).
	NATS NATS `ignored:"true"`
}

// NATS is how every process authenticates to NATS, and how many replicas
// the streams and buckets it creates get.
type NATS struct {
	// Replicas is the streams' and buckets' replica count: 1 on one server,
	// 3 in a 3-node cluster.
	Replicas int `envconfig:"PDQ_NATS_REPLICAS" default:"1"`
	// User and Password, or Token, or Creds (a .creds file) authenticate;
	// credentials in PDQ_NATS_URL work too.
	User     string `envconfig:"PDQ_NATS_USER"`
	Password string `envconfig:"PDQ_NATS_PASSWORD"`
	Token    string `envconfig:"PDQ_NATS_TOKEN"`
	Creds    string `envconfig:"PDQ_NATS_CREDS"`
	// CA is a PEM file of the CAs that sign the server's certificate; Cert
	// and Key are the client's certificate for mutual TLS.
	CA   string `envconfig:"PDQ_NATS_CA"`
	Cert string `envconfig:"PDQ_NATS_CERT"`
	Key  string `envconfig:"PDQ_NATS_KEY"`
}

// The values of PDQ_PREFILL_FALLBACK.
const (
	FallbackDecode = "decode"
	FallbackFail   = "fail"
)

// The values of PDQ_FAIR_LIMIT.
const (
	FairLimitSlots   = "slots"
	FairLimitEngines = "engines"
)

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid configuration")

// process reads spec, whose tags carry each variable's full name, PDQ_
// included, with no prefix: envconfig falls back to a tag's name when the
// prefixed variable is unset, so with the prefix given separately a USER or
// KEY set for anything else (every shell sets USER) would have configured
// pdq as PDQ_NATS_USER or PDQ_NATS_KEY.
func process(spec any) error {
	return envconfig.Process("", spec)
}

// Load reads the configuration from the environment and validates it.
func Load() (Config, error) {
	var c Config
	if err := errors.Join(process(&c), process(&c.NATS)); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	_, c.NATSListenSet = os.LookupEnv("PDQ_NATS_LISTEN")
	c.PrefillEngines = trimAll(c.PrefillEngines)
	c.DecodeEngines = trimAll(c.DecodeEngines)
	c.APIKeys = trimAll(c.APIKeys)
	c.OperatorKeys = trimAll(c.OperatorKeys)
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// LoadLog reads only the logging configuration, for commands that need
// nothing else.
func LoadLog() (Log, error) {
	var l Log
	if err := process(&l); err != nil {
		return Log{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return l, l.Validate()
}

// Validate checks the logging settings.
func (l Log) Validate() error {
	if _, err := logging.ParseLevel(l.Level); err != nil {
		return fmt.Errorf("%w: PDQ_LOG_LEVEL: %w", ErrInvalid, err)
	}
	switch strings.ToLower(l.Format) {
	case logging.FormatAuto, logging.FormatText, logging.FormatJSON:
		return nil
	}
	return fmt.Errorf("%w: PDQ_LOG_FORMAT: %q is not text or json", ErrInvalid, l.Format)
}

// Validate checks values that would otherwise fail later and less clearly.
func (c Config) Validate() error {
	var errs []error
	if err := c.Log.Validate(); err != nil {
		errs = append(errs, err)
	}
	check := func(name string, urls ...string) {
		for _, u := range urls {
			if err := checkEngineURL(u); err != nil {
				errs = append(errs, fmt.Errorf("%w: %s: %w", ErrInvalid, name, err))
			}
		}
	}
	check("PDQ_PREFILL_ENGINES", c.PrefillEngines...)
	check("PDQ_DECODE_ENGINES", c.DecodeEngines...)
	if c.EngineURL != "" {
		check("PDQ_ENGINE_URL", c.EngineURL)
	}
	if c.EngineSlots < 0 {
		errs = append(errs, fmt.Errorf("%w: PDQ_ENGINE_SLOTS must not be negative, got %d", ErrInvalid, c.EngineSlots))
	}
	if c.DisaggMinPromptTokens < 0 {
		errs = append(errs, fmt.Errorf("%w: PDQ_DISAGG_MIN_PROMPT_TOKENS must not be negative, got %d", ErrInvalid, c.DisaggMinPromptTokens))
	}
	positive := func(name string, ok bool, v any) {
		if !ok {
			errs = append(errs, fmt.Errorf("%w: %s must be positive, got %v", ErrInvalid, name, v))
		}
	}
	positive("PDQ_REQUEST_TIMEOUT", c.RequestTimeout > 0, c.RequestTimeout)
	positive("PDQ_BODY_TIMEOUT", c.BodyTimeout > 0, c.BodyTimeout)
	positive("PDQ_KV_TTL", c.KVTTL > 0, c.KVTTL)
	if c.AckWait < 300*time.Millisecond {
		errs = append(errs, fmt.Errorf("%w: PDQ_ACK_WAIT must be at least 300ms, got %v", ErrInvalid, c.AckWait))
	}
	positive("PDQ_MAX_GENERATIONS", c.MaxGenerations > 0, c.MaxGenerations)
	positive("PDQ_MAX_INFLIGHT_BYTES", c.MaxInflightBytes > 0, c.MaxInflightBytes)
	positive("PDQ_MAX_QUEUE", c.MaxQueue > 0, c.MaxQueue)
	positive("PDQ_MAX_DELIVER", c.MaxDeliver > 0, c.MaxDeliver)
	positive("PDQ_PREFILL_TIMEOUT", c.PrefillTimeout > 0, c.PrefillTimeout)
	if c.StallTimeout < time.Second {
		errs = append(errs, fmt.Errorf("%w: PDQ_STALL_TIMEOUT must be at least 1s, got %v", ErrInvalid, c.StallTimeout))
	}
	switch c.PrefillFallback {
	case FallbackDecode, FallbackFail:
	default:
		errs = append(errs, fmt.Errorf("%w: PDQ_PREFILL_FALLBACK: %q is not decode or fail", ErrInvalid, c.PrefillFallback))
	}
	switch c.FairLimit {
	case FairLimitSlots, FairLimitEngines:
	default:
		errs = append(errs, fmt.Errorf("%w: PDQ_FAIR_LIMIT: %q is not slots or engines", ErrInvalid, c.FairLimit))
	}
	for name, w := range c.TenantWeights {
		if !(w > 0) || math.IsInf(w, 0) {
			errs = append(errs, fmt.Errorf("%w: PDQ_TENANT_WEIGHTS: the weight of %q must be a positive number, got %v", ErrInvalid, name, w))
		}
	}
	if c.MigrationLimit < 0 {
		errs = append(errs, fmt.Errorf("%w: PDQ_MIGRATION_LIMIT must not be negative, got %d", ErrInvalid, c.MigrationLimit))
	}
	positive("PDQ_BREAKER_FAILURES", c.BreakerFailures > 0, c.BreakerFailures)
	positive("PDQ_SHUTDOWN_GRACE", c.ShutdownGrace > 0, c.ShutdownGrace)
	if err := c.NATS.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.HTTPAddr == "" {
		errs = append(errs, fmt.Errorf("%w: PDQ_HTTP_ADDR must not be empty", ErrInvalid))
	}
	return errors.Join(errs...)
}

// LoadNATS reads only the NATS connection settings, for the one-shot
// tools, which take everything else as flags.
func LoadNATS() (NATS, error) {
	var n NATS
	if err := process(&n); err != nil {
		return NATS{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return n, n.Validate()
}

// Validate checks the NATS settings that need no file: one way to
// authenticate, and a client certificate with its key. The files are
// read, and checked, when connecting.
func (n NATS) Validate() error {
	var errs []error
	if n.Replicas < 1 || n.Replicas > 5 {
		errs = append(errs, fmt.Errorf("%w: PDQ_NATS_REPLICAS must be 1 to 5, got %d", ErrInvalid, n.Replicas))
	}
	if (n.Cert == "") != (n.Key == "") {
		errs = append(errs, fmt.Errorf("%w: PDQ_NATS_CERT and PDQ_NATS_KEY go together", ErrInvalid))
	}
	if n.Password != "" && n.User == "" {
		errs = append(errs, fmt.Errorf("%w: PDQ_NATS_PASSWORD needs PDQ_NATS_USER", ErrInvalid))
	}
	ways := 0
	for _, set := range []bool{n.User != "", n.Token != "", n.Creds != ""} {
		if set {
			ways++
		}
	}
	if ways > 1 {
		errs = append(errs, fmt.Errorf("%w: set one of PDQ_NATS_USER (with PDQ_NATS_PASSWORD), PDQ_NATS_TOKEN and PDQ_NATS_CREDS", ErrInvalid))
	}
	return errors.Join(errs...)
}

// checkEngineURL accepts an absolute http(s) URL with a host: the base URL
// of an OpenAI-compatible engine, such as http://10.0.0.5:8000.
func checkEngineURL(s string) error {
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%q: %w", s, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%q is not an http(s) URL with a host", s)
	}
	return nil
}

func trimAll(in []string) []string {
	out := in[:0]
	for _, s := range in {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// Names lists every environment variable the services read, PDQ_NATS_*
// included: for docs and for tests that check a deployment sets only
// variables pdq knows.
func Names() ([]string, error) {
	var b strings.Builder
	for _, spec := range []any{&Config{}, &NATS{}} {
		if err := envconfig.Usagef("", spec, &b, "{{range .}}{{usage_key .}}\n{{end}}"); err != nil {
			return nil, err
		}
	}
	return strings.Fields(b.String()), nil
}

// Unknown is a PDQ_ variable of the environment that pdq does not read,
// with the known name nearest to it ("" when none is near).
type Unknown struct {
	Name, Nearest string
}

// UnknownNames finds the PDQ_ variables of environ (as os.Environ gives
// them) that pdq does not read: a mistyped name is otherwise ignored in
// silence, and its setting with it.
func UnknownNames(environ []string) ([]Unknown, error) {
	known, err := Names()
	if err != nil {
		return nil, err
	}
	var out []Unknown
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "PDQ_") || slices.Contains(known, name) {
			continue
		}
		u := Unknown{Name: name}
		best := len(name)/3 + 1 // nearer than this, or it is no typo
		for _, k := range known {
			if d := editDistance(name, k); d < best {
				u.Nearest, best = k, d
			}
		}
		out = append(out, u)
	}
	slices.SortFunc(out, func(a, b Unknown) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}
