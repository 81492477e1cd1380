package enginemetrics

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	text := `# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="pdq-sim"} 3
vllm:num_requests_waiting{model_name="other"} 2
vllm:num_requests_running{model_name="a } b",engine="0"} 7 1712345678000
vllm:prefix_cache_hits_total{model_name="x\"}"} 1.5e3
vllm:prefix_cache_queries_total 4096

go_goroutines 12
bad_value{a="b"} NaNx
broken{a="b" 1
`
	m, err := Parse(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{Waiting: 5, Running: 7, PrefixHits: 1500, PrefixQueries: 4096, "go_goroutines": 12}
	for k, v := range want {
		if m[k] != v {
			t.Errorf("%s = %v, want %v", k, m[k], v)
		}
	}
	if len(m) != len(want) {
		t.Errorf("parsed %v, want only %v", m, want)
	}
}
