package config

import "time"

// The defaults of the PDQ_* variables: Load gives them to an unset
// variable (the envconfig tags on Config spell the same values, which
// TestDefaults holds them to), and the constructors of the gateway, the
// workers and the stage loops take every value they use, refusing a
// missing one rather than filling it in.
const (
	// DefaultDisaggMinPromptTokens: prompts estimated shorter than this
	// skip the prefill stage; the decode engine prefills them itself,
	// which costs less than a KV transfer's fixed overhead.
	DefaultDisaggMinPromptTokens = 16
	// DefaultRequestTimeout is every request's deadline.
	DefaultRequestTimeout = 10 * time.Minute
	// DefaultKVTTL is how old a handoff may be when a decode worker pulls
	// it; older ones go back to prefill. It is under vLLM's 30 s KV lease.
	DefaultKVTTL = 25 * time.Second
	// DefaultAckWait is how long a job may go without an ack or InProgress
	// before it is redelivered to another worker: a crashed worker's jobs
	// move on after this long. Running jobs send InProgress every third of
	// it.
	DefaultAckWait = 30 * time.Second
	// DefaultMaxGenerations bounds the prefills one request may start.
	DefaultMaxGenerations = 3
	// DefaultMaxQueue bounds the jobs waiting in one pool's queue of a
	// stage; past it the gateway answers 429.
	DefaultMaxQueue = 1024
	// DefaultBodyTimeout bounds the read of a request body: 7 MiB at
	// 250 KB/s.
	DefaultBodyTimeout = 30 * time.Second
	// DefaultMaxInflightBytes bounds the request bodies the gateway holds
	// at once.
	DefaultMaxInflightBytes = 512 << 20
	// DefaultMaxDeliver is how many deliveries of one job a stage runs
	// before the job fails for good. The stage loop counts them at pull,
	// not the consumer: a consumer's own limit would leave an exhausted
	// message sitting in the work queue with nobody to answer its client.
	DefaultMaxDeliver = 4
	// DefaultPrefillTimeout bounds a prefill engine's answer.
	DefaultPrefillTimeout = 60 * time.Second
	// DefaultStallTimeout bounds a decode's silence: the engine's, before
	// its first chunk and between chunks, and the worker's, between its
	// beats to the gateway.
	DefaultStallTimeout = 30 * time.Second
	// DefaultMigrationLimit bounds how many times one request's decode
	// moves to another engine after output was sent.
	DefaultMigrationLimit = 1
	// DefaultShutdownGrace is how long running requests may finish after
	// SIGTERM.
	DefaultShutdownGrace = 30 * time.Second
	// DefaultBreakerFailures is how many consecutive engine failures open
	// a worker's breaker.
	DefaultBreakerFailures = 3
	// DefaultPrefillSlots and DefaultDecodeSlots are a worker's engine
	// slots when PDQ_ENGINE_SLOTS is 0. A prefill is compute-bound and
	// gains little from a deep batch; decode batches well.
	DefaultPrefillSlots = 8
	DefaultDecodeSlots  = 64
)

// Settings no variable sets: fixed here, beside the defaults, and passed
// by cmd/pdq like them; tests give their own.
const (
	// MaxBodyBytes keeps a job, body and envelope, under NATS's 8 MiB
	// message limit.
	MaxBodyBytes = 7 << 20
	// RetryBase is the first retry's delay; each next one is 4 times
	// longer: 250 ms, 1 s, 4 s.
	RetryBase = 250 * time.Millisecond
	// PullWait is how long the server keeps a pull request waiting for a
	// job: how long a stopping loop waits for its pull to end, at most
	// while its server answers. An idle loop pulls again this often, and
	// each pull of a replicated consumer is two Raft entries (its start
	// and its end): four a second per idle loop, where the jetstream
	// client's 30 s pulls made four a minute.
	PullWait = 500 * time.Millisecond
	// KeepEvery is how often, at most, a loop that takes jobs renews its
	// stream's keeper.
	KeepEvery = 2 * time.Second
	// FairLoad is the prompt tokens the gateway's fair queue lets in, and
	// not started, for each engine of a pool's first stage, beyond one
	// request an engine (see gateway's fairQueue): about the tokens past
	// which a prefill step's cost grows with its tokens, not its fixed
	// part, so that batching more prompts only slows each alike (doubled
	// while the work is of one tenant and one priority:
	// fair.Limit.AlikeLoad).
	FairLoad = 2048
	// ModelsRefresh is how often a worker reads its engine's /v1/models
	// again: an adapter loaded at run time is served within this time.
	ModelsRefresh = 10 * time.Second
)

// EngineSlotsFor is a worker's engine slots: PDQ_ENGINE_SLOTS, or its role's
// default when that is 0.
func (c Config) EngineSlotsFor(prefill bool) int {
	switch {
	case c.EngineSlots > 0:
		return c.EngineSlots
	case prefill:
		return DefaultPrefillSlots
	}
	return DefaultDecodeSlots
}
