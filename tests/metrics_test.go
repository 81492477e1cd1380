package tests

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
)

// metricValue sums the samples of name whose labels include every one of
// labels (`key="value"`), in a Prometheus text exposition.
func metricValue(exposition, name string, labels ...string) (float64, bool) {
	var sum float64
	found := false
	for _, line := range strings.Split(exposition, "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		series := line[:strings.LastIndexByte(line, ' ')]
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(series, l)
		}
		if !ok {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
			sum += v
			found = true
		}
	}
	return sum, found
}

// TestMetricsCountTraffic sends known traffic through a live `pdq up` and
// checks that /metrics counts it: requests by outcome, latencies, queue
// waits and engine times per stage, decode-only requests, and the gauges.
func TestMetricsCountTraffic(t *testing.T) {
	up, url := startUp(t)
	// A worker settles a job after its client has the answer: the counts
	// are read once no job runs.
	scrape := func() string {
		deadline := time.Now().Add(10 * time.Second)
		for {
			body := string(get(t, url+"/metrics").body)
			p, _ := metricValue(body, "pdq_inflight", `stage="prefill"`)
			d, _ := metricValue(body, "pdq_inflight", `stage="decode"`)
			// The gateway's own, after the client has its last byte.
			gr, _ := metricValue(body, "pdq_gateway_inflight_requests")
			gb, _ := metricValue(body, "pdq_gateway_inflight_bytes")
			if p == 0 && d == 0 && gr == 0 && gb == 0 || time.Now().After(deadline) {
				return body
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	before := scrape()
	delta := func(after, name string, labels ...string) float64 {
		a, _ := metricValue(after, name, labels...)
		b, _ := metricValue(before, name, labels...)
		return a - b
	}

	for i := range 3 { // P/D, streamed
		s := postStream(t, url+"/v1/completions", fmt.Sprintf("m-stream-%d", i),
			completionBody(model, longPrompt, body{"max_tokens": 8, "ignore_eos": true, "stream": true}))
		if s.status != 200 || !s.done {
			t.Fatalf("stream %d: %+v", i, s)
		}
	}
	for i := range 2 { // decode-only: a short prompt
		parseResponse(t, post(t, url+"/v1/chat/completions", fmt.Sprintf("m-short-%d", i), chatBody(model, "Hi", body{"max_tokens": 4})))
	}
	post(t, url+"/v1/completions", "", "{not json").wantStatus(t, 400)
	post(t, url+"/v1/completions", "", completionBody("no-such-model", "Hi", body{"max_tokens": 1})).wantStatus(t, 404)
	after := scrape()

	sim := `model="` + model + `"`
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"pdq_requests_total", []string{sim, `outcome="ok"`}, 5},
		{"pdq_requests_total", []string{`model="unknown"`, `outcome="client_error"`}, 2},
		{"pdq_ttft_seconds_count", []string{sim}, 5},
		{"pdq_e2e_seconds_count", []string{sim}, 5},
		{"pdq_decode_only_total", []string{`reason="short_prompt"`}, 2},
		{"pdq_queue_wait_seconds_count", []string{`stage="prefill"`}, 3},
		{"pdq_queue_wait_seconds_count", []string{`stage="decode"`}, 5},
		{"pdq_engine_seconds_count", []string{`stage="prefill"`}, 3},
		{"pdq_engine_seconds_count", []string{`stage="decode"`}, 5},
		{"pdq_retries_total", nil, 0},
		{"pdq_dead_letters_total", nil, 0},
		{"pdq_kv_params_missing_total", nil, 0},
		{"pdq_prefills_wasted_total", []string{`reason="kv_ttl"`}, 0},
	} {
		if _, ok := metricValue(after, c.name, c.labels...); !ok {
			t.Errorf("%s%v is not exported", c.name, c.labels)
		} else if got := delta(after, c.name, c.labels...); got != c.want {
			t.Errorf("%s%v went up by %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	// Each stream wrote 8 tokens: 7 gaps between its chunks, and more for
	// the final usage-less chunk it may send.
	if got := delta(after, "pdq_itl_seconds_count", sim); got < 3*7 {
		t.Errorf("pdq_itl_seconds_count went up by %v, want at least 21", got)
	}
	for _, g := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"pdq_inflight", []string{`stage="decode"`}, 0},
		{"pdq_engine_up", []string{`stage="prefill"`}, 1},
		{"pdq_engine_up", []string{`stage="decode"`}, 1},
		{"pdq_engine_breaker_state", []string{`stage="prefill"`, `state="closed"`}, 1},
		{"pdq_engine_breaker_state", []string{`stage="decode"`, `state="closed"`}, 1},
		{"pdq_engine_breaker_state", []string{`state="open"`}, 0},
		{"pdq_engine_breaker_state", []string{`state="half-open"`}, 0},
		// Every request answered: the gateway holds none, nor their bytes.
		{"pdq_gateway_inflight_requests", nil, 0},
		{"pdq_gateway_inflight_bytes", nil, 0},
	} {
		if got, ok := metricValue(after, g.name, g.labels...); !ok || got != g.want {
			t.Errorf("%s%v = %v (present %v), want %v", g.name, g.labels, got, ok, g.want)
		}
	}
	if v, ok := metricValue(after, "pdq_build_info", `goversion="go`); !ok || v != 1 {
		t.Errorf("pdq_build_info = %v (present %v), want 1 with the build's labels", v, ok)
	}
	for _, stage := range []string{"prefill", "decode"} {
		// The engine's slots follow its load, from a few up to
		// PDQ_ENGINE_SLOTS.
		if got, ok := metricValue(after, "pdq_engine_slots", `stage="`+stage+`"`); !ok || got < 1 {
			t.Errorf("pdq_engine_slots{stage=%q} = %v (present %v), want at least 1", stage, got, ok)
		}
	}
	if _, ok := metricValue(after, "pdq_queue_depth", `stage="prefill"`, `pool="`); !ok {
		t.Errorf("no pdq_queue_depth for the prefill queue:\n%s", after)
	}

	// The logs are for operators: at most one INFO line per request, and a
	// client's mistake is never an ERROR.
	info, seen := map[string]int{}, 0
	for _, line := range strings.Split(up.output(), "\n") {
		var rec struct {
			Level string `json:"level"`
			ID    string `json:"request_id"`
			Msg   string `json:"msg"`
		}
		if json.Unmarshal([]byte(line), &rec) != nil {
			continue
		}
		if rec.Level == "ERROR" {
			t.Errorf("an ERROR line: %s", line)
		}
		if strings.HasPrefix(rec.ID, "m-") {
			seen++
			if rec.Level == "INFO" {
				info[rec.ID]++
			}
		}
	}
	if seen == 0 {
		t.Fatal("no log line names an m- request: the checks below would read nothing")
	}
	for id, n := range info {
		if n > 1 {
			t.Errorf("request %s has %d INFO lines, want at most 1", id, n)
		}
	}
	// Every m- request above succeeded at its first try: operations.md
	// promises those log nothing at INFO.
	for id, n := range info {
		if n > 0 {
			t.Errorf("request %s succeeded and has %d INFO lines, want none", id, n)
		}
	}
}
