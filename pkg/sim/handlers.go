package sim

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pdq-dev/pdq/internal/sleep"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/kvstore"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

// maxBodyBytes bounds a request body.
const maxBodyBytes = 64 << 20

// engineDeadMessage is what vLLM answers once its EngineCore has died.
const engineDeadMessage = "EngineCore encountered an issue. See stack trace (above) for the root cause."

var (
	// errDropped ends a response whose connection a fault closed.
	errDropped = errors.New("connection dropped by injected fault")
	// errClientGone wraps a failed write to a client that went away.
	errClientGone = errors.New("client went away")
)

func (e *Engine) routes() http.Handler {
	mux := http.NewServeMux()
	if e.cfg.Runner == simconfig.RunnerPooling {
		// vLLM registers the routes of the tasks the model supports only.
		mux.HandleFunc("POST /v1/embeddings", e.embeddings)
		mux.HandleFunc("POST /v1/chat/completions", fastAPINotFound)
		mux.HandleFunc("POST /v1/completions", fastAPINotFound)
	} else {
		mux.HandleFunc("POST /v1/chat/completions", e.generate(openai.Chat))
		mux.HandleFunc("POST /v1/completions", e.generate(openai.Completions))
		mux.HandleFunc("POST /v1/embeddings", fastAPINotFound)
	}
	mux.HandleFunc("GET /v1/models", e.models)
	if e.cfg.RuntimeLoRA {
		mux.HandleFunc("POST /v1/load_lora_adapter", e.loadLoRA)
		mux.HandleFunc("POST /v1/unload_lora_adapter", e.unloadLoRA)
	}
	mux.HandleFunc("POST /tokenize", e.tokenize)
	mux.HandleFunc("POST /detokenize", e.detokenize)
	mux.HandleFunc("GET /version", e.version)
	mux.HandleFunc("GET /health", e.health)
	mux.Handle("GET /metrics", promhttp.HandlerFor(e.registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /sim/stats", e.getStats)
	mux.HandleFunc("GET /sim/faults", e.getFaults)
	mux.HandleFunc("POST /sim/faults", e.setFaults)
	mux.HandleFunc("GET /sim/requests", e.getRequests)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		openai.WriteError(w, openai.NewError(http.StatusNotFound, "no route for %s %s", r.Method, r.URL.Path))
	})
	return e.record(e.requireKey(mux))
}

// fastAPINotFound is what vLLM (FastAPI) answers on a route it did not
// register: /v1/embeddings on a generative model, the generation routes on
// a pooling one.
func fastAPINotFound(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusNotFound)
	io.WriteString(w, `{"detail":"Not Found"}`)
}

// requireKey checks the bearer token on /v1 routes, as vLLM's --api-key
// does, with vLLM's exact 401 body.
func (e *Engine) requireKey(next http.Handler) http.Handler {
	if e.cfg.APIKey == "" {
		return next
	}
	want := []byte("Bearer " + e.cfg.APIKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/") && subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			io.WriteString(w, `{"error":"Unauthorized"}`)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// generate serves one of the two generation endpoints.
func (e *Engine) generate(endpoint openai.Endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		e.stats.requests.Add(1)
		if e.dead.Load() {
			e.fail(w, openai.NewError(http.StatusInternalServerError, engineDeadMessage))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
		if err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				e.fail(w, openai.NewError(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", tooBig.Limit))
				return
			}
			e.stats.aborts.Add(1)
			return // the client went away while sending
		}
		jobs, apiErr := e.parse(endpoint, r, body)
		if apiErr != nil {
			e.fail(w, apiErr)
			return
		}
		ctx := r.Context()
		kind, delay := e.faults.Draw()
		switch kind {
		case simconfig.Fault503:
			e.stats.faults.Add(1)
			e.fail(w, openai.NewError(http.StatusServiceUnavailable, "injected fault: the engine is overloaded, try again later"))
			return
		case simconfig.Fault500:
			e.stats.faults.Add(1)
			e.fail(w, openai.NewError(http.StatusInternalServerError, "injected fault: internal engine error"))
			return
		case simconfig.Fault429:
			e.stats.faults.Add(1)
			e.fail(w, openai.NewError(http.StatusTooManyRequests, "injected fault: too many requests"))
			return
		case simconfig.FaultHang:
			e.stats.faults.Add(1)
			jobs[0].log.Debug("injected fault: hanging until the client goes away")
			<-ctx.Done()
			e.abortBeforeScheduling(ctx, jobs)
			return
		case simconfig.FaultSlow:
			e.stats.faults.Add(1)
			if sleep.For(ctx, delay) != nil {
				e.abortBeforeScheduling(ctx, jobs)
				return
			}
		}
		if jobs[0].req.Stream {
			e.stream(ctx, w, jobs, kind == simconfig.FaultDrop)
		} else {
			e.respond(ctx, w, jobs, kind, delay)
		}
	}
}

// runBatch runs the jobs of one request at once, as vLLM runs the prompts
// of a batch, handing each token to emit, one call at a time. On the first
// failure it stops the others and returns that failure. noKV applies to the
// first prompt, whose kv_transfer_params the response carries.
func (e *Engine) runBatch(ctx context.Context, jobs []*job, noKV bool, emit func(*job, token) error) ([]outcome, error) {
	if len(jobs) == 1 {
		j := jobs[0]
		out, err := e.execute(ctx, j, noKV, func(t token) error { return emit(j, t) })
		return []outcome{out}, err
	}
	bctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		mu     sync.Mutex
		wg     sync.WaitGroup
		failed atomic.Bool
	)
	outs := make([]outcome, len(jobs))
	for i, j := range jobs {
		wg.Go(func() {
			out, err := e.execute(bctx, j, noKV && i == 0, func(t token) error {
				mu.Lock()
				defer mu.Unlock()
				return emit(j, t)
			})
			if err != nil {
				failed.Store(true)
				cancel(err) // the first cause wins
				return
			}
			outs[i] = out
		})
	}
	wg.Wait()
	if failed.Load() {
		return nil, context.Cause(bctx)
	}
	return outs, nil
}

// sumUsage is the usage of a request: its prompts' tokens and all they
// generated, and with --enable-prompt-tokens-details those not computed.
func (e *Engine) sumUsage(jobs []*job, outs []outcome) *openai.Usage {
	u := &openai.Usage{}
	cached := 0
	for i, j := range jobs {
		u.PromptTokens += j.prompt.Tokens
		u.CompletionTokens += outs[i].tokens
		cached += outs[i].cached
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	if e.cfg.PromptTokensDetails && cached > 0 {
		u.PromptTokensDetails = &openai.PromptTokensDetails{CachedTokens: cached}
	}
	return u
}

// respond runs a non-streaming request and writes its JSON: one choice per
// prompt (index = prompt index, as n is 1), usage summed, and, as vLLM's
// completion serving does, the kv_transfer_params of the first prompt only.
func (e *Engine) respond(ctx context.Context, w http.ResponseWriter, jobs []*job, kind simconfig.FaultKind, delay time.Duration) {
	texts := make([]strings.Builder, len(jobs))
	outs, err := e.runBatch(ctx, jobs, kind == simconfig.FaultNoKV, func(j *job, t token) error {
		texts[j.index].WriteString(t.text)
		return nil
	})
	first := jobs[0]
	if err != nil {
		e.finishWithError(ctx, w, first, nil, err)
		return
	}
	switch kind {
	case simconfig.FaultDrop:
		e.stats.faults.Add(1)
		e.dropConnection(w, first)
		return
	case simconfig.FaultLate:
		e.stats.faults.Add(1)
		if sleep.For(ctx, delay) != nil {
			// The work is done: a prefill's blocks stay held for their
			// lease, for a read that will not come.
			first.log.Debug("client went away before the late answer")
			return
		}
	}
	usage := e.sumUsage(jobs, outs)
	var resp any
	switch first.endpoint {
	case openai.Chat:
		resp = openai.ChatCompletion{
			ID: first.respID, Object: openai.ObjectChatCompletion, Created: first.created, Model: first.target.name,
			Choices: []openai.ChatChoice{{
				Message:      openai.ChatMessage{Role: "assistant", Content: texts[0].String(), ToolCalls: []any{}},
				FinishReason: outs[0].finish,
			}},
			Usage: usage, KVTransferParams: outs[0].kvParams,
		}
	default:
		choices := make([]openai.CompletionChoice, len(jobs))
		for i := range jobs {
			choices[i] = openai.CompletionChoice{Index: i, Text: texts[i].String(), FinishReason: &outs[i].finish}
		}
		resp = openai.Completion{
			ID: first.respID, Object: openai.ObjectTextCompletion, Created: first.created, Model: first.target.name,
			Choices: choices, Usage: usage, KVTransferParams: outs[0].kvParams,
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

// stream runs a streaming request with vLLM's SSE framing: for chat a first
// chunk with the role, one chunk per token with finish_reason on the last,
// a usage chunk with empty choices when include_usage is set, then [DONE].
// The prompts of a batch stream at once, their chunks interleaved under
// one id, each with its prompt's index; the usage chunk sums them.
func (e *Engine) stream(ctx context.Context, w http.ResponseWriter, jobs []*job, drop bool) {
	first := jobs[0]
	sse := openai.NewSSEWriter(w)
	withUsage := first.req.IncludeUsage()
	continuous := withUsage && first.req.StreamOptions.ContinuousUsageStats
	send := func(v any) error {
		if err := sse.JSON(v); err != nil {
			return errors.Join(errClientGone, err)
		}
		return nil
	}
	usageAt := func(j *job, completion int) *openai.Usage {
		if !continuous {
			return nil
		}
		return openai.NewUsage(j.prompt.Tokens, completion)
	}
	dropped := false // runBatch calls emit one at a time
	outs, err := e.runBatch(ctx, jobs, false, func(j *job, t token) error {
		if dropped {
			return errDropped // the other prompts of a batch, after the drop
		}
		if drop && j.index == 0 && t.i == t.n/2 {
			e.stats.faults.Add(1)
			e.dropConnection(w, j)
			dropped = true
			return errDropped
		}
		var finish *string
		if t.finish != "" {
			finish = &t.finish
		}
		if j.endpoint == openai.Chat {
			if t.i == 0 {
				empty := ""
				if err := send(e.chatChunk(j, openai.ChatDelta{Role: "assistant", Content: &empty}, nil, usageAt(j, 0))); err != nil {
					return err
				}
			}
			c := e.chatChunk(j, openai.ChatDelta{Content: &t.text}, finish, usageAt(j, t.i+1))
			if finish != nil {
				c.Choices[0].StopReason = json.RawMessage("null")
			}
			return send(c)
		}
		return send(openai.CompletionChunk{
			ID: j.respID, Object: openai.ObjectTextCompletion, Created: j.created, Model: j.target.name,
			Choices: []openai.CompletionChoice{{Index: j.index, Text: t.text, FinishReason: finish}},
			Usage:   usageAt(j, t.i+1),
		})
	})
	if err != nil {
		e.finishWithError(ctx, w, first, sse, err)
		return
	}
	if withUsage {
		usage := e.sumUsage(jobs, outs)
		var chunk any = openai.ChatChunk{ID: first.respID, Object: openai.ObjectChatCompletionChunk, Created: first.created, Model: first.target.name, Choices: []openai.ChatChunkChoice{}, Usage: usage}
		if first.endpoint == openai.Completions {
			chunk = openai.CompletionChunk{ID: first.respID, Object: openai.ObjectTextCompletion, Created: first.created, Model: first.target.name, Choices: []openai.CompletionChoice{}, Usage: usage}
		}
		if send(chunk) != nil {
			e.stats.aborts.Add(1)
			return
		}
	}
	if sse.Done() != nil {
		e.stats.aborts.Add(1)
	}
}

func (e *Engine) chatChunk(j *job, delta openai.ChatDelta, finish *string, usage *openai.Usage) openai.ChatChunk {
	return openai.ChatChunk{
		ID: j.respID, Object: openai.ObjectChatCompletionChunk, Created: j.created, Model: j.target.name,
		Choices: []openai.ChatChunkChoice{{Delta: delta, FinishReason: finish}},
		Usage:   usage,
	}
}

// abortBeforeScheduling ends a request aborted before it reached the
// scheduler. A decode request then tells its prefill engine to free the
// blocks it will never read, as vLLM's request_finished does for an
// aborted request.
func (e *Engine) abortBeforeScheduling(ctx context.Context, jobs []*job) {
	e.stats.aborts.Add(1)
	for _, j := range jobs {
		if j.mode == modeDecode {
			e.releaseRemote(ctx, j)
		}
	}
}

// finishWithError ends a request that execute could not finish: nothing
// more for an abort or a dropped connection, else an error envelope, in
// the stream once it has started.
func (e *Engine) finishWithError(ctx context.Context, w http.ResponseWriter, j *job, sse *openai.SSEWriter, err error) {
	switch {
	case errors.Is(err, errDropped):
		return
	case ctx.Err() != nil || errors.Is(err, errClientGone):
		e.stats.aborts.Add(1)
		j.log.Debug("request aborted: the client went away", logging.Ms("duration_ms", time.Since(j.start)))
		return
	}
	apiErr := openai.NewError(http.StatusInternalServerError, "%v", err)
	if errors.Is(err, kvstore.ErrEngineDead) {
		apiErr = openai.NewError(http.StatusInternalServerError, engineDeadMessage)
	}
	if sse == nil {
		e.fail(w, apiErr)
		return
	}
	// vLLM streams a failure as a 200 with an in-stream error event.
	e.stats.errors.Add(1)
	if sse.Error(apiErr) != nil {
		e.stats.aborts.Add(1)
	}
}

// dropConnection closes the client's connection without finishing the
// response, as a crashed engine or a broken network would.
func (e *Engine) dropConnection(w http.ResponseWriter, j *job) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		j.log.Warn("injected drop: cannot take over the connection; ending the response early instead", logging.Err(err))
		return
	}
	conn.Close()
}

func (e *Engine) fail(w http.ResponseWriter, apiErr *openai.Error) {
	e.stats.errors.Add(1)
	openai.WriteError(w, apiErr)
}

// health answers 200 with an empty body, 503 once the engine is dead.
func (e *Engine) health(w http.ResponseWriter, _ *http.Request) {
	if e.dead.Load() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) getStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, e.snapshot())
}

func (e *Engine) getFaults(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, e.faults.Get())
}

// setFaults replaces the injected fault: {"rate": 0..1, "kind": K}, with an
// optional "delay" for slow ("2s" or milliseconds). Rate 0 turns faults off.
func (e *Engine) setFaults(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Rate  *float64            `json:"rate"`
		Kind  simconfig.FaultKind `json:"kind"`
		Delay *simconfig.Duration `json:"delay"`
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "invalid fault: %v", err))
		return
	}
	if in.Rate == nil {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "invalid fault: 'rate' is required").WithParam("rate"))
		return
	}
	f := e.faults.Get()
	f.Rate, f.Kind = *in.Rate, in.Kind
	if in.Delay != nil {
		f.Delay = *in.Delay
	}
	if err := e.SetFault(f); err != nil {
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "invalid fault: %v", err))
		return
	}
	e.log.Info("fault injection changed", "rate", f.Rate, "kind", f.Kind, "delay", f.Delay)
	writeJSON(w, http.StatusOK, f)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		openai.WriteError(w, openai.NewError(http.StatusInternalServerError, "encode response: %v", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}
