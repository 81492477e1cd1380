package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/pkg/bench/pyfmt"
)

// sample makes the run's requests from its dataset, with their tenants and
// priorities.
func sample(cfg Config, s settings) ([]SampleRequest, error) {
	var reqs []SampleRequest
	var err error
	switch cfg.DatasetName {
	case "multi_turn":
		reqs, err = MultiTurnDataset{Turns: cfg.MultiTurnTurns, CommonPrefixLen: cfg.MultiTurnCommonPrefixLen, PrefixLen: cfg.MultiTurnPrefixLen,
			UserLen: cfg.MultiTurnUserLen, OutputLen: cfg.MultiTurnOutputLen, Seed: uint64(cfg.Seed)}.Sample(cfg.NumPrompts, cfg.RequestIDPrefix)
	case "prefix_repetition":
		reqs, err = PrefixRepetitionDataset{PrefixLen: cfg.PrefixRepetitionPrefixLen, SuffixLen: cfg.PrefixRepetitionSuffixLen,
			NumPrefixes: cfg.PrefixRepetitionNumPrefixes, OutputLen: cfg.PrefixRepetitionOutputLen, Seed: uint64(cfg.Seed)}.
			Sample(cfg.NumPrompts, cfg.RequestIDPrefix)
	default:
		reqs, err = RandomDataset{InputLen: cfg.RandomInputLen, OutputLen: cfg.RandomOutputLen, PrefixLen: cfg.RandomPrefixLen,
			RangeRatio: cfg.RandomRangeRatio, Seed: uint64(cfg.Seed)}.Sample(cfg.NumPrompts, cfg.RequestIDPrefix)
	}
	if err != nil {
		return nil, err
	}
	if err := applyMixes(reqs, s.tenants, s.priorities, uint64(cfg.Seed), cfg.DatasetName == "multi_turn"); err != nil {
		return nil, err
	}
	return reqs, nil
}

// Run benchmarks the server as `vllm bench serve` does and prints what it
// prints to stdout: a few lines about the run, the errors of up to 10
// failed requests, then the "Serving Benchmark Result" block. A progress
// bar goes to progress, if not nil.
//
// Requests are sent at the times of [Delays], each in its own goroutine,
// at most cfg.MaxConcurrency at once (a request waiting for a slot counts
// its wait as client queue time, not latency). With cfg.PDPrefill each
// request is two legs, as vLLM's toy P/D proxy makes them: the prefill
// leg to the prefill engine, then the decode leg, with the prefill's
// kv_transfer_params, to the base URL; TTFT and latency count from the
// start of the prefill leg.
//
// It fails on bad settings (wrapping [ErrInvalid]), when the model cannot
// be found, or when ctx ends; a failed request is a result, not an error.
func Run(ctx context.Context, cfg Config, stdout, progressTo io.Writer) (*Result, error) {
	s, err := cfg.check()
	if err != nil {
		return nil, err
	}
	perHost := cfg.MaxConcurrency
	if perHost == 0 {
		perHost = cfg.NumPrompts
	}
	hc := &http.Client{
		Transport: &http.Transport{
			Proxy:               http.ProxyFromEnvironment,
			MaxIdleConns:        0,
			MaxIdleConnsPerHost: perHost,
			MaxConnsPerHost:     cfg.MaxConcurrency,
			IdleConnTimeout:     60 * time.Second,
		},
		Timeout: 6 * time.Hour, // vLLM's AIOHTTP_TIMEOUT
	}
	defer hc.CloseIdleConnections()

	modelName, modelID := cfg.Model, cfg.Model
	if cfg.Model == "" {
		fmt.Fprintln(stdout, "Model not specified, fetching first model from server...")
		if modelName, modelID, err = firstModel(ctx, hc, s.baseURL, cfg.APIKey); err != nil {
			return nil, err
		}
		fmt.Fprintf(stdout, "First model name: %s, first model id: %s\n", modelName, modelID)
	}

	reqs, err := sample(cfg, s)
	if err != nil {
		return nil, err
	}
	arrivals := len(reqs) // requests, or conversations that start
	if cfg.DatasetName == "multi_turn" {
		arrivals = cfg.NumPrompts
	}
	delays := Delays(arrivals, cfg.RequestRate, cfg.Burstiness, uint32(cfg.Seed))
	if cfg.Tokenizer != "" {
		fmt.Fprintf(stdout, "pdq bench loads no tokenizer (--tokenizer %s): prompts are made of words, and output tokens are the server's usage.\n", cfg.Tokenizer)
	}

	c := &client{
		http:       hc,
		apiURL:     s.apiURL,
		prefillURL: s.prefillURL,
		chat:       s.chat,
		model:      modelName,
		apiKey:     cfg.APIKey,
		origin:     time.Now(),
	}
	if err := c.testRun(ctx, cfg, reqs[0], stdout); err != nil {
		return nil, err
	}

	fmt.Fprintln(stdout, "Starting main benchmark run...")
	fmt.Fprintf(stdout, "Traffic request rate: %s\n", pyfmt.Repr(cfg.RequestRate))
	distribution := "Gamma distribution"
	if cfg.Burstiness == 1.0 {
		distribution = "Poisson process"
	}
	fmt.Fprintf(stdout, "Burstiness factor: %s (%s)\n", pyfmt.Repr(cfg.Burstiness), distribution)
	maxConc := "None"
	if cfg.MaxConcurrency > 0 {
		maxConc = strconv.Itoa(cfg.MaxConcurrency)
	}
	fmt.Fprintf(stdout, "Maximum request concurrency: %s\n", maxConc)

	start := time.Now()
	c.origin = start
	var bar *progress
	if progressTo != nil {
		bar = newProgress(progressTo, len(reqs))
	}
	var sem chan struct{}
	if cfg.MaxConcurrency > 0 {
		sem = make(chan struct{}, cfg.MaxConcurrency)
	}
	outputs := make([]Output, len(reqs))
	// send sends request i, which arrived at arrival, once a
	// --max-concurrency slot is free, and says whether it succeeded.
	send := func(i int, req SampleRequest, arrival time.Time) bool {
		if sem != nil {
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-ctx.Done():
				outputs[i] = Output{PromptLen: req.PromptLen, Error: ctx.Err().Error()}
				return false
			}
		}
		out := c.do(ctx, req)
		out.ClientQueueTime = out.StartTime - arrival.Sub(start).Seconds()
		outputs[i] = out
		bar.inc()
		return out.Success
	}
	var wg sync.WaitGroup
	if cfg.DatasetName == "multi_turn" {
		turns := cfg.MultiTurnTurns
		think := time.Duration(cfg.MultiTurnThinkTime * float64(time.Second))
		for conv := range arrivals {
			if err := sleepUntil(ctx, start.Add(time.Duration(delays[conv]*float64(time.Second)))); err != nil {
				break
			}
			wg.Go(func() { converse(ctx, reqs[conv*turns:(conv+1)*turns], conv*turns, think, outputs, send, bar) })
		}
	} else {
		for i, req := range reqs {
			if err := sleepUntil(ctx, start.Add(time.Duration(delays[i]*float64(time.Second)))); err != nil {
				break
			}
			arrival := time.Now()
			wg.Go(func() { send(i, req, arrival) })
		}
	}
	wg.Wait()
	bar.close()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dur := time.Since(start).Seconds()

	m := Calculate(outputs, dur, s.percentiles, s.goodput)
	var failed []Output
	for _, o := range outputs {
		if !o.Success {
			failed = append(failed, o)
		}
	}
	if len(failed) > 0 {
		fmt.Fprintln(stdout, "Failed requests during benchmark run detected (capping to 10):")
		for i, o := range failed[:min(len(failed), 10)] {
			fmt.Fprintf(stdout, "Error %d: %s\n", i, o.Error)
		}
	}
	rep := Report{
		Metrics:           m,
		Duration:          dur,
		MaxConcurrency:    cfg.MaxConcurrency,
		RequestRate:       cfg.RequestRate,
		Goodput:           s.goodput.set(),
		PercentileMetrics: s.percentileMetrics,
		Percentiles:       s.percentiles,
	}
	if cfg.MaxConcurrency > 0 {
		rep.QueueTimes = []float64{}
		for _, o := range outputs {
			if o.Success {
				rep.QueueTimes = append(rep.QueueTimes, o.ClientQueueTime)
			}
		}
		if !math.IsInf(cfg.RequestRate, 1) {
			rep.E2ELInclQueue = []float64{}
			for _, o := range outputs {
				if o.Success {
					rep.E2ELInclQueue = append(rep.E2ELInclQueue, o.Latency+o.ClientQueueTime)
				}
			}
		}
	}
	if err := rep.WriteBlock(stdout); err != nil {
		return nil, err
	}
	gs := groups(reqs, outputs, dur, s.goodput)
	if err := writeExtras(stdout, outputs, gs, s.goodput.set()); err != nil {
		return nil, err
	}

	res := &Result{Report: rep, Outputs: outputs, Groups: gs}
	res.JSON = resultJSON(cfg, modelID, time.Now(), &rep, outputs)
	if !cfg.SaveDetailed {
		for _, k := range []string{"input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"} {
			res.JSON.Del(k)
		}
	}
	if cfg.SaveResult {
		name := resultFilename(cfg, modelID, res.JSON)
		if cfg.ResultDir != "" {
			if err := os.MkdirAll(cfg.ResultDir, 0o755); err != nil {
				return res, err
			}
			name = filepath.Join(cfg.ResultDir, name)
		}
		b, err := res.MarshalJSON()
		if err != nil {
			return res, err
		}
		if err := os.WriteFile(name, b, 0o644); err != nil {
			return res, fmt.Errorf("save result: %w", err)
		}
		res.File = name
	}
	return res, nil
}

// converse runs one conversation's turns in order, each with the history
// before it, think after the previous answer. Turns after a failed one
// are not sent: they fail too.
func converse(ctx context.Context, turns []SampleRequest, first int, think time.Duration, outputs []Output,
	send func(int, SampleRequest, time.Time) bool, bar *progress) {
	var history []Message
	for k, req := range turns {
		if k > 0 && sleepUntil(ctx, time.Now().Add(think)) != nil {
			return
		}
		req.History = history
		if !send(first+k, req, time.Now()) {
			for rest := k + 1; rest < len(turns); rest++ {
				outputs[first+rest] = Output{PromptLen: turns[rest].PromptLen, Error: "not sent: an earlier turn of its conversation failed"}
				bar.inc()
			}
			return
		}
		history = append(history, Message{Role: "user", Text: req.Prompt}, Message{Role: "assistant", Text: outputs[first+k].GeneratedText})
	}
}

// sleepUntil waits for t or for ctx to end.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// firstModel is vLLM's get_first_model_from_server: the id (the name to
// send) and root (the model) of the first model of GET /v1/models. A
// server whose cards have no root gives the id for both.
func firstModel(ctx context.Context, hc *http.Client, baseURL, apiKey string) (name, id string, err error) {
	url := baseURL + "/v1/models"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", "", err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return "", "", fmt.Errorf("failed to fetch models from server at %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return "", "", fmt.Errorf("failed to fetch models from server at %s: %s", url, statusError(resp))
	}
	var list struct {
		Data []struct {
			ID   string `json:"id"`
			Root string `json:"root"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		return "", "", fmt.Errorf("failed to fetch models from server at %s: %w", url, err)
	}
	if len(list.Data) == 0 {
		return "", "", fmt.Errorf("no models found on the server at %s: make sure the server is running and has models loaded", baseURL)
	}
	name, id = list.Data[0].ID, list.Data[0].Root
	if id == "" {
		id = name
	}
	return name, id, nil
}

// testRun is vLLM's initial test run and warmup: the first prompt is sent
// until it succeeds, every 5 s for at most cfg.ReadyCheckTimeoutSec (a
// server still starting is waited for; one that refuses the run's
// settings stops it here, not after a thousand failures), then
// cfg.NumWarmups more times, at most cfg.MaxConcurrency at once. None of
// them is measured. Each has a request id of its own (the run's prefix
// and test-N or warmup-N), as pdq refuses an id it has answered.
func (c *client) testRun(ctx context.Context, cfg Config, first SampleRequest, stdout io.Writer) error {
	fmt.Fprintln(stdout, "Starting initial single prompt test run...")
	if cfg.ReadyCheckTimeoutSec == 0 {
		fmt.Fprintln(stdout, "Skipping endpoint ready check.")
	} else {
		timeout := time.Duration(cfg.ReadyCheckTimeoutSec) * time.Second
		fmt.Fprintf(stdout, "Waiting for endpoint to become up in %d seconds\n", cfg.ReadyCheckTimeoutSec)
		deadline := time.Now().Add(timeout)
		for i := 0; ; i++ {
			req := first
			req.RequestID = fmt.Sprintf("%stest-%d", cfg.RequestIDPrefix, i)
			rctx, cancel := context.WithDeadline(ctx, deadline)
			out := c.do(rctx, req)
			cancel()
			if err := ctx.Err(); err != nil {
				return err
			}
			if out.Success {
				break
			}
			wait := min(5*time.Second, time.Until(deadline))
			if wait <= 0 {
				return fmt.Errorf("bench: Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: %s", out.Error)
			}
			if err := sleepUntil(ctx, time.Now().Add(wait)); err != nil {
				return err
			}
		}
		fmt.Fprintln(stdout, "Initial test run completed.")
	}
	if cfg.NumWarmups == 0 {
		return nil
	}
	fmt.Fprintf(stdout, "Warming up with %d requests...\n", cfg.NumWarmups)
	conc := cfg.MaxConcurrency
	if conc == 0 {
		conc = cfg.NumWarmups
	}
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	for i := range cfg.NumWarmups {
		req := first
		req.RequestID = fmt.Sprintf("%swarmup-%d", cfg.RequestIDPrefix, i)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c.do(ctx, req) // a failed warmup is not the run's failure, as in vLLM
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "Warmup run completed.")
	return nil
}
