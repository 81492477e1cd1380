// Package bench is pdq's load generator: `vllm bench serve` for the random
// dataset, in Go, so that its numbers can be set beside vLLM's. It takes
// vLLM's flags and defaults, sends vLLM's requests and prints vLLM's
// "Serving Benchmark Result" block with the same labels, order and number
// formats; --save-result writes vLLM's result JSON. It works against any
// OpenAI-compatible server: pdq's gateway, a bare engine, another router.
//
// The reference is vllm/benchmarks/serve.py (get_request, calculate_metrics,
// benchmark, main_async, compute_result_filename),
// vllm/benchmarks/lib/endpoint_request_func.py (the OpenAI completions and
// chat request functions) and vllm/benchmarks/datasets (RandomDataset,
// add_dataset_parser).
//
// # What matches vLLM
//
//   - Requests: stream true with stream_options.include_usage; completions
//     send max_tokens (and vLLM's repetition_penalty 1.0, logprobs null),
//     chat a single user message with one text part and
//     max_completion_tokens; ignore_eos true, which vLLM sets for the random
//     dataset whether or not --ignore-eos is given; X-Request-Id prefix +
//     index; Authorization: Bearer $OPENAI_API_KEY when set.
//   - Timing: TTFT at the first SSE message with a non-empty choices list,
//     ITL between later ones (pooled over requests), E2EL at the last one;
//     usage.completion_tokens as output tokens and usage.prompt_tokens as
//     input tokens, as current vLLM reads them; success is status 200 and
//     at least one choice.
//   - Statistics: numpy's mean, median, population std and default
//     (linear) percentile, to the last bit (see package
//     [github.com/pdq-dev/pdq/pkg/bench/pyfmt]), in milliseconds; goodput;
//     peak output tokens per second and peak concurrency.
//   - Arrivals: [Delays], with numpy's legacy RandomState, so a seed gives
//     vLLM's schedule; --max-concurrency as a semaphore.
//   - The printed block ([Report.WriteBlock]) and the result file.
//
// # What differs
//
//   - There is no tokenizer. Prompts are words ([RandomDataset]), one
//     token each for pdq sim, and input tokens are counted from
//     usage.prompt_tokens (falling back to the word count). Output tokens
//     without usage are counted as the messages with a choice, where vLLM
//     would tokenize the text. The result's tokenizer_id is null.
//   - Only the random dataset, the openai (alias vllm) and openai-chat
//     backends, and no ramp-up, warm-up, profiling, LoRA, sampling, header
//     or metadata flags. --endpoint defaults to the backend's path (vLLM's
//     is /v1/completions for both).
//   - A request that is not answered 200 fails with the reason phrase and
//     the body's first 500 bytes (vLLM keeps the reason only); unknown
//     --percentile-metrics names are an error (vLLM ignores them).
//   - No "tip: install termplotlib" or ready-check lines, no
//     .pytorch.json file. Start times are seconds from the start of the run
//     (vLLM's are time.perf_counter values).
//   - --pd-prefill drives both legs of a disaggregated request itself, as
//     vLLM's toy P/D proxy would between the client and the engines.
package bench
