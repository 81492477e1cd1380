package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/kvstore"
	"github.com/pdq-dev/pdq/pkg/sim/sched"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

// kvLoadError is a failed KV load under --kv-load-failure fail: vLLM ends
// such a request with finish_reason "error", a 500 or an in-stream error.
type kvLoadError struct{ err error }

func (e *kvLoadError) Error() string {
	return "failed to load KV cache from the prefill engine: " + e.err.Error()
}
func (e *kvLoadError) Unwrap() error { return e.err }

// notifyTimeout bounds a release notification sent after the request that
// owed it has ended.
const notifyTimeout = 2 * time.Second

// token is one output token handed to the response writer.
type token struct {
	i, n   int    // index and total count
	text   string // the token's text
	finish string // set on the last token
}

// outcome is a finished request.
type outcome struct {
	tokens   int
	finish   string
	kvParams json.RawMessage
	// cached is the prompt tokens not computed (batched engines).
	cached int
}

// execute runs a request through the engine: wait for a slot, get the KV
// cache (prefill it, or read it from the prefill engine), then say the
// tokens at the ITL, handing each to emit. It returns ctx's error when the
// client went away.
func (e *Engine) execute(ctx context.Context, j *job, noKV bool, emit func(token) error) (outcome, error) {
	if e.batch != nil {
		return e.executeBatched(ctx, j, noKV, emit)
	}
	defer j.markLoaded()
	if err := j.waitLoadAfter(ctx); err != nil {
		return outcome{}, err
	}
	release, err := e.admit(ctx, j)
	if err != nil {
		return outcome{}, err
	}
	defer release()

	digest := j.prompt.Digest
	switch j.mode {
	case modeDecode:
		loaded, err := e.loadKV(ctx, j, time.Duration(len(j.remote.blockIDs))*e.cfg.KVTransferPerBlock)
		j.markLoaded()
		var recompute bool
		if digest, recompute, err = e.judgeLoad(ctx, j, loaded, err); err != nil {
			return outcome{}, err
		}
		if recompute {
			if err := sleep.For(ctx, e.prefillTime(j)); err != nil {
				return outcome{}, err
			}
		}
	default:
		if err := sleep.For(ctx, e.prefillTime(j)); err != nil {
			return outcome{}, err
		}
	}

	n, finish := e.outputLength(j, digest)
	for i := range n {
		if i > 0 {
			if err := sleep.For(ctx, e.cfg.ITL); err != nil {
				return outcome{}, err
			}
		}
		if e.dead.Load() {
			return outcome{}, kvstore.ErrEngineDead
		}
		t := token{i: i, n: n, text: j.gen.Token(digest, i)}
		if i == 0 && j.prompt.MidWord {
			t.text = " " + t.text // going on from a partial answer: a new word
		}
		if i == n-1 {
			t.finish = finish
		}
		if err := emit(t); err != nil {
			return outcome{}, err
		}
	}

	return e.finished(j, n, finish, noKV, nil)
}

// executeBatched is execute on a batched engine: the request waits in the
// scheduler's queue, reads its KV when the scheduler gives it blocks (a
// decode), and says each token as a step samples it.
func (e *Engine) executeBatched(ctx context.Context, j *job, noKV bool, emit func(token) error) (outcome, error) {
	defer j.markLoaded()
	if err := j.waitLoadAfter(ctx); err != nil {
		return outcome{}, err
	}
	digest := j.prompt.Digest
	n, finish := e.outputLength(j, digest)
	r := &sched.Request{ID: j.internalID, Kind: sched.Local, PromptTokens: j.prompt.Tokens, Hashes: j.hashes,
		MaxTokens: n, Priority: j.req.Priority}
	switch j.mode {
	case modePrefill:
		r.Kind = sched.Prefill
	case modeDecode:
		// How many tokens it says depends on the KV it reads.
		r.Kind, r.MaxTokens = sched.Decode, j.maxTokens
	}
	st, err := e.batch.Add(r)
	if err != nil {
		return outcome{}, err
	}
	defer e.batch.Close(st)

	if j.mode == modeDecode {
		stopHeartbeat := e.heartbeat(ctx, j)
		select {
		case <-st.Load():
		case <-ctx.Done():
		}
		stopHeartbeat()
		if ctx.Err() != nil {
			e.releaseRemote(ctx, j)
			return outcome{}, ctx.Err()
		}
		loaded, err := e.loadKV(ctx, j, e.batch.Transfer(st, e.cfg.BlockSize))
		j.markLoaded()
		var recompute bool
		if digest, recompute, err = e.judgeLoad(ctx, j, loaded, err); err != nil {
			return outcome{}, err
		}
		n, finish = e.outputLength(j, digest)
		e.batch.Loaded(st, !recompute, n)
	}

	for i := 0; i < n; {
		got, done, err := e.batch.Wait(ctx, st, i)
		if err != nil {
			return outcome{}, err
		}
		for ; i < min(got, n); i++ {
			if e.dead.Load() {
				return outcome{}, kvstore.ErrEngineDead
			}
			t := token{i: i, n: n, text: j.gen.Token(digest, i)}
			if i == 0 && j.prompt.MidWord {
				t.text = " " + t.text
			}
			if i == n-1 {
				t.finish = finish
			}
			if err := emit(t); err != nil {
				return outcome{}, err
			}
		}
		if done && i < n {
			return outcome{}, fmt.Errorf("sim: scheduler ended %s after %d of %d tokens", j.internalID, i, n)
		}
	}
	e.batch.Keep(st)
	out, err := e.finished(j, n, finish, noKV, func() { e.batch.Release(r) })
	out.cached = r.CachedTokens()
	return out, err
}

// finished ends a request that said its n tokens: a length-capped prefill
// holds its KV blocks for the decode (freed is called when they are
// freed); the engine counts it.
func (e *Engine) finished(j *job, n int, finish string, noKV bool, freed func()) (outcome, error) {
	out := outcome{tokens: n, finish: finish}
	switch j.mode {
	case modePrefill:
		switch {
		case noKV:
			e.stats.faults.Add(1)
			j.log.Debug("injected fault: prefill answers without kv_transfer_params")
		case finish != openai.FinishLength:
			// vLLM returns params only for a length-capped prefill; a
			// router that forgot max_tokens=1 gets null and no held blocks.
			j.log.Warn("prefill stopped before max_tokens; no KV blocks held, kv_transfer_params is null", "tokens", n)
		default:
			blocks := e.kv.Hold(j.internalID, j.baseID, e.numBlocks(j.prompt.Tokens), j.prompt.Tokens, j.prompt.Digest, freed)
			var err error
			if out.kvParams, err = e.paramsFor(j, blocks); err != nil {
				return outcome{}, err
			}
			e.stats.prefills.Add(1)
			freed = nil
		}
	case modeDecode:
		e.stats.decodes.Add(1)
	default:
		e.stats.local.Add(1)
	}
	if freed != nil {
		freed() // no blocks held for a decode
	}
	e.stats.promptTokens.Add(int64(j.prompt.Tokens))
	e.stats.generationTokens.Add(int64(n))
	j.log.Debug("request finished", "prompt_tokens", j.prompt.Tokens, "tokens", n, "finish_reason", finish,
		logging.Ms("duration_ms", time.Since(j.start)))
	return out, nil
}

// judgeLoad is what a decode does after its KV load: go on from the KV it
// read (another prompt's, if the blocks held another prompt), die (a v1
// read of an id the prefill engine does not hold), fail the request, or
// recompute the prompt, as --kv-load-failure says.
func (e *Engine) judgeLoad(ctx context.Context, j *job, loaded string, err error) (digest string, recompute bool, _ error) {
	switch {
	case err == nil:
		if loaded != j.prompt.Digest {
			e.stats.kvMismatches.Add(1)
			j.log.Warn("loaded KV cache belongs to another prompt; the output will be wrong", "kv_digest", loaded, "prompt_digest", j.prompt.Digest)
		}
		e.stats.kvReads.Add(1)
		return loaded, false, nil
	case ctx.Err() != nil:
		return "", false, ctx.Err()
	case e.cfg.Protocol == simconfig.ProtocolV1 && errors.Is(err, kvstore.ErrUnknownRequest):
		e.stats.kvReadFailures.Add(1)
		e.die(j.internalID, err)
		return "", false, kvstore.ErrEngineDead
	}
	e.stats.kvReadFailures.Add(1)
	if e.cfg.KVLoadFailure == simconfig.LoadFailureFail {
		j.log.Warn("KV load failed; failing the request (kv_load_failure_policy=fail)", logging.Err(err))
		return "", false, &kvLoadError{err: err}
	}
	j.log.Warn("KV load failed; recomputing the prompt locally (kv_load_failure_policy=recompute)", logging.Err(err))
	e.stats.recomputes.Add(1)
	return j.prompt.Digest, true, nil
}

// outputLength is how many tokens the request gets and why it stops: the
// model's natural length (at least min_tokens) unless ignore_eos, capped by
// max_tokens.
func (e *Engine) outputLength(j *job, digest string) (int, string) {
	if j.req.IgnoreEOS {
		return j.maxTokens, openai.FinishLength
	}
	n := max(j.gen.NaturalLength(digest), j.minTokens)
	if n >= j.maxTokens {
		return j.maxTokens, openai.FinishLength
	}
	return n, openai.FinishStop
}

func (e *Engine) prefillTime(j *job) time.Duration {
	return e.cfg.PrefillOverhead + time.Duration(j.prompt.Tokens)*e.cfg.PrefillPerToken
}

// admit waits for one of the engine's --max-num-seqs slots. A decode request
// that waits keeps its prefill's blocks alive with heartbeats, and frees
// them if its client gives up first, as vLLM's decode does.
func (e *Engine) admit(ctx context.Context, j *job) (release func(), err error) {
	select {
	case e.slots <- struct{}{}:
	default:
		e.stats.waiting.Add(1)
		stopHeartbeat := func() {}
		if j.mode == modeDecode {
			stopHeartbeat = e.heartbeat(ctx, j)
		}
		select {
		case e.slots <- struct{}{}:
		case <-ctx.Done():
			err = ctx.Err()
		}
		stopHeartbeat()
		e.stats.waiting.Add(-1)
		if err != nil {
			if j.mode == modeDecode {
				e.releaseRemote(ctx, j)
			}
			return nil, err
		}
	}
	e.stats.running.Add(1)
	return func() {
		e.stats.running.Add(-1)
		<-e.slots
	}, nil
}

// remoteID is the id under which this engine asks the prefill engine for a
// request's blocks: the prefill's remote_request_id in v2, but its own
// internal id in v1, which only matches when both legs had one X-Request-Id.
func (e *Engine) remoteID(j *job) string {
	if e.cfg.Protocol == simconfig.ProtocolV1 {
		return j.internalID
	}
	return j.remote.requestID
}

// loadKV reads a request's blocks from the prefill engine and returns the
// digest of the prompt they hold. After a successful read it always
// notifies the prefill engine, so the blocks are freed even if the client
// goes away during the transfer; if the request is aborted before the read,
// it notifies too.
func (e *Engine) loadKV(ctx context.Context, j *job, transfer time.Duration) (string, error) {
	c, rd, err := e.readKV(ctx, j)
	if err != nil {
		if ctx.Err() != nil {
			e.releaseRemote(ctx, j)
		}
		return "", err
	}
	defer c.Close()
	transferErr := sleep.For(ctx, transfer)
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifyTimeout)
	defer cancel()
	if _, err := c.Call(nctx, kvstore.Request{Op: kvstore.OpNotify, RequestID: e.remoteID(j), TPSize: j.remote.tpSize}); err != nil {
		j.log.Warn("could not notify the prefill engine that its KV blocks are read; they stay held until the lease ends", logging.Err(err))
	}
	if transferErr != nil {
		return "", transferErr
	}
	return rd.Digest, nil
}

// readKV connects to the prefill engine, checks that it is the engine the
// params name, and reads the request's blocks. On success the caller owns
// the connection.
func (e *Engine) readKV(ctx context.Context, j *job) (*kvstore.Conn, kvstore.Reply, error) {
	c, err := kvstore.Dial(ctx, j.remote.addr())
	if err != nil {
		return nil, kvstore.Reply{}, err
	}
	hs, err := c.Call(ctx, kvstore.Request{Op: kvstore.OpHandshake, EngineID: e.engineID, Compat: e.compat})
	if err == nil && hs.EngineID != j.remote.engineID {
		err = fmt.Errorf("handshake with %s: engine id is %q, kv_transfer_params say %q", j.remote.addr(), hs.EngineID, j.remote.engineID)
	}
	var rd kvstore.Reply
	if err == nil {
		rd, err = c.Call(ctx, kvstore.Request{Op: kvstore.OpRead, EngineID: e.engineID, RequestID: e.remoteID(j), BlockIDs: j.remote.blockIDs, PeerRequestID: j.baseID})
	}
	if err != nil {
		c.Close()
		return nil, kvstore.Reply{}, err
	}
	return c, rd, nil
}

// releaseRemote tells the prefill engine to free a request's blocks that
// this engine will never read (the empty-block notification of vLLM's
// request_finished).
func (e *Engine) releaseRemote(ctx context.Context, j *job) {
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifyTimeout)
	defer cancel()
	err := kvstore.OneShot(nctx, j.remote.addr(), kvstore.Request{Op: kvstore.OpNotify, RequestID: e.remoteID(j), TPSize: j.remote.tpSize})
	if err != nil {
		j.log.Warn("could not release the prefill engine's KV blocks of an aborted request; they stay held until the lease ends", logging.Err(err))
		return
	}
	j.log.Debug("released the prefill engine's KV blocks of an aborted request")
}

// heartbeat renews the prefill's lease every --kv-heartbeat until stopped.
func (e *Engine) heartbeat(ctx context.Context, j *job) (stop func()) {
	hctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(e.cfg.KVHeartbeat)
		defer t.Stop()
		for {
			select {
			case <-hctx.Done():
				return
			case <-t.C:
			}
			if err := kvstore.OneShot(hctx, j.remote.addr(), kvstore.Request{Op: kvstore.OpHeartbeat, RequestID: e.remoteID(j)}); err != nil && hctx.Err() == nil {
				j.log.Warn("KV lease heartbeat failed", logging.Err(err))
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
	}
}
