// Package enginemetrics reads a vLLM engine's /metrics (Prometheus text
// format) for the tools that route to engines or measure them: the
// least-loaded policy of tools/pdproxy and make bench-cluster's
// prefix-cache counters.
package enginemetrics

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// vLLM's series that the tools read.
const (
	Running       = "vllm:num_requests_running"
	Waiting       = "vllm:num_requests_waiting"
	KVUsage       = "vllm:kv_cache_usage_perc"
	PrefixQueries = "vllm:prefix_cache_queries_total"
	PrefixHits    = "vllm:prefix_cache_hits_total"
	// Busy is pdq sim's own: the time an engine spent in steps.
	Busy = "pdq_sim_busy_seconds_total"
)

// Parse reads Prometheus text exposition and returns each metric's value,
// summed over its series (an engine serving several model names has one
// series per name). Comments, blank lines and lines whose value is not a
// number are skipped; a timestamp after the value is ignored.
func Parse(r io.Reader) (map[string]float64, error) {
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ \t"); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		if strings.HasPrefix(rest, "{") {
			// Label values may hold spaces and braces inside quotes.
			end := labelsEnd(rest)
			if end < 0 {
				continue
			}
			rest = rest[end+1:]
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			continue
		}
		out[name] += v
	}
	return out, sc.Err()
}

// labelsEnd is the index of the '}' that closes the label set that s
// starts with, or -1.
func labelsEnd(s string) int {
	quoted, escaped := false, false
	for i := 1; i < len(s); i++ {
		c := s[i]
		switch {
		case escaped:
			escaped = false
		case c == '\\' && quoted:
			escaped = true
		case c == '"':
			quoted = !quoted
		case c == '}' && !quoted:
			return i
		}
	}
	return -1
}

// Fetch reads the metrics of the engine at baseURL (GET baseURL/metrics).
func Fetch(ctx context.Context, client *http.Client, baseURL string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(baseURL, "/")+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, resp.Body)
		return nil, fmt.Errorf("GET %s/metrics: %s", baseURL, resp.Status)
	}
	return Parse(resp.Body)
}
