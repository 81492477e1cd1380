// Package sched models the scheduler and KV cache of one vLLM (V1) engine,
// in steps and in virtual time: what runs in each engine step, what it
// costs, and who waits. pdq sim drives it with real sleeps (Batcher);
// tests and the calibration drive it with a virtual clock (PD), so that
// its figures are the model's and not the machine's.
//
// The model follows vLLM's v1/core/sched/scheduler.py and
// v1/core/kv_cache_manager.py, simplified where the difference does not
// change who waits how long:
//
//   - Continuous batching. Each step has a token budget
//     (max_num_batched_tokens) and a seat limit (max_num_seqs). Running
//     requests are served first, one token each for a decode and the rest
//     of their prompt (up to the budget) for a prefill; then waiting
//     requests are admitted in policy order while budget, seats and KV
//     blocks last. A prompt longer than the budget is prefilled in chunks
//     (chunked prefill), one chunk a step.
//   - A step costs Base + PerPrefillToken × prefill tokens computed +
//     PerDecodeSeq × decoding sequences: so inter-token latency grows with
//     the batch, and a long prefill slows the decodes that share its step.
//   - KV capacity in blocks of BlockSize tokens. A request holds the blocks
//     of its computed tokens; a prefill for a remote decode keeps them after
//     it finishes until Release (the decode read them, or the lease ran
//     out), as the NIXL connector's delayed free does. When a running
//     request needs a block and none is free, the scheduler preempts (frees
//     and requeues) the last running request under fcfs, or the one of the
//     lowest priority (highest value, latest arrival) under priority, and
//     recomputes it later, as vLLM's recompute preemption does.
//   - Automatic prefix caching. A full prompt block is named by a hash
//     chained over the hash of the block before it, its token ids and the
//     LoRA adapter (tokenizer.BlockHashes). A new request reuses the
//     longest run of cached blocks from its start, capped so that its last
//     prompt token is computed (vLLM samples from it). Freed blocks keep
//     their hash and go to the tail of an LRU free list, a request's last
//     block first, so that prefixes are evicted last; a block is evicted
//     only when it is taken for new tokens. Only prompt blocks are hashed:
//     vLLM also hashes blocks of generated tokens, which a following turn
//     reuses only when its template re-tokenizes the answer the same way.
//   - A decode with remote KV (do_remote_prefill) reuses its own cached
//     prefix, gets blocks for the whole prompt, and waits, without using
//     the budget, while the engine reads the other blocks from the prefill
//     engine (Loaded); it then computes its last prompt token and samples
//     from it, as vLLM's NIXL connector recomputes the last token.
package sched
