// Package simtest starts simulated engines for tests: real servers on
// 127.0.0.1 with real side channels, stopped when the test ends.
package simtest

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

// Engine is a running simulated engine.
type Engine struct {
	*sim.Engine
	// URL is the engine's base URL, http://127.0.0.1:port.
	URL string
}

// FastConfig is simconfig.DefaultConfig with latencies cut to what keeps tests
// quick and a side channel on a free loopback port.
func FastConfig() simconfig.Config {
	c := simconfig.DefaultConfig()
	c.Addr = "127.0.0.1:0"
	c.KVHost = "127.0.0.1"
	c.KVPort = 0
	c.PrefillOverhead = time.Millisecond
	c.PrefillPerToken = 0
	c.KVTransferPerBlock = 0
	c.ITL = 0
	// PDQ_SIM_PROFILE runs the suites on batched engines instead, their
	// costs scaled down a hundredfold.
	if p := os.Getenv("PDQ_SIM_PROFILE"); p != "" {
		c.Profile, c.TimeScale = p, 0.01
	}
	return c
}

// Start runs an engine with cfg until the test ends. Addr and KVPort are
// ignored: both listeners take free ports on 127.0.0.1 (the advertised
// remote_host is still cfg.KVHost).
func Start(t testing.TB, cfg simconfig.Config) *Engine {
	t.Helper()
	e, err := sim.New(cfg, logging.Discard())
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	httpLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	kvLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Serve(ctx, httpLn, kvLn) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("simtest: engine stopped with %v", err)
		}
	})
	return &Engine{Engine: e, URL: "http://" + httpLn.Addr().String()}
}

// Stats reads the engine's counters over HTTP, from GET /sim/stats.
func (e *Engine) Stats(t testing.TB) sim.Stats {
	t.Helper()
	s, err := FetchStats(context.Background(), e.URL)
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	return s
}

// FetchStats reads GET /sim/stats of the engine at baseURL.
func FetchStats(ctx context.Context, baseURL string) (sim.Stats, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/sim/stats", nil)
	if err != nil {
		return sim.Stats{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return sim.Stats{}, fmt.Errorf("get stats: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return sim.Stats{}, fmt.Errorf("get stats: status %d", resp.StatusCode)
	}
	var s sim.Stats
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		return sim.Stats{}, fmt.Errorf("decode stats: %w", err)
	}
	return s, nil
}

// WaitStats polls the engine's counters until cond holds, and fails the
// test with the last counters if it does not within timeout. Use it for
// what happens after a response has been written, such as an abort being
// noticed or a lease running out.
func (e *Engine) WaitStats(t testing.TB, timeout time.Duration, what string, cond func(sim.Stats) bool) sim.Stats {
	t.Helper()
	s, err := e.Poll(timeout, cond)
	if err != nil {
		t.Fatalf("simtest: %s: %v", what, err)
	}
	return s
}

// Poll is WaitStats for goroutines other than the test's, which must not
// call t.Fatal: it returns an error instead.
func (e *Engine) Poll(timeout time.Duration, cond func(sim.Stats) bool) (sim.Stats, error) {
	deadline := time.Now().Add(timeout)
	for {
		s, err := FetchStats(context.Background(), e.URL)
		if err != nil {
			return s, err
		}
		if cond(s) {
			return s, nil
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("not within %v; stats: %+v", timeout, s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Requests reads GET /sim/requests?id=<id>: what the engine received under
// that X-Request-Id, bodies byte for byte, in arrival order.
func (e *Engine) Requests(t testing.TB, id string) []sim.RecordedRequest {
	t.Helper()
	rs, err := FetchRequests(context.Background(), e.URL, &id)
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	return rs
}

// RecentRequests reads GET /sim/requests: the last 64 requests the engine
// received, without their bodies.
func (e *Engine) RecentRequests(t testing.TB) []sim.RecordedRequest {
	t.Helper()
	rs, err := FetchRequests(context.Background(), e.URL, nil)
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	return rs
}

// FetchRequests reads GET /sim/requests of the engine at baseURL, for one
// X-Request-Id if id is not nil.
func FetchRequests(ctx context.Context, baseURL string, id *string) ([]sim.RecordedRequest, error) {
	u := baseURL + "/sim/requests"
	if id != nil {
		u += "?id=" + url.QueryEscape(*id)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("get requests: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("get requests: status %d", resp.StatusCode)
	}
	var out sim.RecordedRequests
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, fmt.Errorf("decode requests: %w", err)
	}
	return out.Requests, nil
}
