package vllm

import (
	"errors"
	"strings"
	"testing"
)

func TestParseLoad(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		want       Load
		err        error
	}{
		{name: "vLLM's", text: `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 40.0
`, want: Load{Running: 12, Waiting: 3}},
		{name: "data parallel: summed", text: `vllm:num_requests_running{engine="0"} 4
vllm:num_requests_running{engine="1"} 5
vllm:num_requests_waiting{engine="0"} 0
vllm:num_requests_waiting{engine="1"} 2
`, want: Load{Running: 9, Waiting: 2}},
		{name: "no labels", text: "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", want: Load{Running: 1}},
		{name: "label values with braces", text: `vllm:num_requests_running{model_name="a}b"} 2 1700000000000` + "\n", want: Load{Running: 2}},
		{name: "not vLLM", text: "# HELP go_goroutines x\ngo_goroutines 7\n", err: ErrNoLoad},
		{name: "bad value", text: "vllm:num_requests_running{} x\n", err: errBad},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseLoad(strings.NewReader(tc.text))
			switch {
			case tc.err == errBad && err == nil, tc.err != errBad && !errors.Is(err, tc.err):
				t.Fatalf("err %v, want %v", err, tc.err)
			case got != tc.want:
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// errBad stands for any error but ErrNoLoad.
var errBad = errors.New("any error")

// BenchmarkParseLoad reads the load from a /metrics of 400 other lines,
// as a worker does every 250 ms while its engine is busy.
func BenchmarkParseLoad(b *testing.B) {
	text := strings.Repeat("# HELP x y\nvllm:e2e_request_latency_seconds_bucket{le=\"0.3\",model_name=\"m\"} 12.0\n", 200) +
		"vllm:num_requests_running{model_name=\"m\"} 3.0\nvllm:num_requests_waiting{model_name=\"m\"} 0.0\n"
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parseLoad(strings.NewReader(text)); err != nil {
			b.Fatal(err)
		}
	}
}
