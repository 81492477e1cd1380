package dispatcher

import (
	"encoding/json"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// metricNames are the names NewMetrics registers, histograms as their
// base name.
func metricNames(t *testing.T) (names map[string]bool) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	fq := regexp.MustCompile(`fqName: "([a-z0-9_]+)"`)
	names = map[string]bool{}
	ch := make(chan *prometheus.Desc, 64)
	go func() {
		for _, c := range m.collectors() {
			c.Describe(ch)
		}
		close(ch)
	}()
	for d := range ch {
		if s := fq.FindStringSubmatch(d.String()); s != nil {
			names[s[1]] = true
		}
	}
	return names
}

// TestDashboardQueriesExist: every metric the Grafana dashboard queries is
// one pdq exports, and the dashboard shows what issue 8 asks of it.
func TestDashboardQueriesExist(t *testing.T) {
	raw, err := os.ReadFile("../deploy/grafana/pdq-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Query any `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	names := metricNames(t)
	used := map[string]bool{}
	metric := regexp.MustCompile(`\bpdq_[a-z0-9_]+`)
	check := func(where, expr string) {
		for _, name := range metric.FindAllString(expr, -1) {
			base := name
			for _, suffix := range []string{"_bucket", "_count", "_sum"} {
				if b, ok := strings.CutSuffix(name, suffix); ok && names[b] {
					base = b
				}
			}
			if !names[base] {
				t.Errorf("%s queries %s, which pdq does not export", where, name)
			}
			used[base] = true
		}
	}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, target := range p.Targets {
			check("panel "+p.Title, target.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		if q, ok := v.Query.(string); ok {
			check("a variable", q)
		}
	}
	for _, want := range []string{"pdq_requests_total", "pdq_ttft_seconds", "pdq_itl_seconds", "pdq_queue_depth",
		"pdq_queue_wait_seconds", "pdq_retries_total", "pdq_dead_letters_total", "pdq_decode_only_total", "pdq_engine_up"} {
		if !used[want] {
			t.Errorf("the dashboard does not show %s", want)
		}
	}
}

// TestHistogramBucketsAreRound: every bucket bound is a number an SLO is
// written against (a whole number of milliseconds, two significant digits
// at most), TTFT's are the ones issue 25 names, and each histogram keeps
// few buckets, since every bound is a series per label value.
func TestHistogramBucketsAreRound(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Request("m", "ok", time.Second, time.Second)
	m.ITL("m").Observe(0.02)
	m.jobStarted(StagePrefill, time.Second)
	m.jobEnded(StagePrefill, time.Second)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	bounds := map[string][]float64{}
	for _, f := range families {
		for _, metric := range f.GetMetric() {
			if h := metric.GetHistogram(); h != nil && bounds[f.GetName()] == nil {
				for _, b := range h.GetBucket() {
					bounds[f.GetName()] = append(bounds[f.GetName()], b.GetUpperBound())
				}
			}
		}
	}
	for _, name := range []string{"pdq_ttft_seconds", "pdq_itl_seconds", "pdq_e2e_seconds", "pdq_queue_wait_seconds", "pdq_engine_seconds"} {
		le := bounds[name]
		if len(le) == 0 {
			t.Errorf("%s has no buckets", name)
		}
		if len(le) > 16 {
			t.Errorf("%s has %d buckets, want 16 at most", name, len(le))
		}
		for _, b := range le {
			ms := b * 1000
			digits := strings.TrimRight(strconv.FormatFloat(ms, 'f', -1, 64), "0")
			if ms != math.Round(ms) || len(strings.ReplaceAll(digits, ".", "")) > 2 {
				t.Errorf("%s has the bucket le=%q: not a round number", name, strconv.FormatFloat(b, 'g', -1, 64))
			}
		}
	}
	if want := []float64{0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}; !slices.Equal(bounds["pdq_ttft_seconds"], want) {
		t.Errorf("pdq_ttft_seconds buckets %v, want %v", bounds["pdq_ttft_seconds"], want)
	}
}

// TestEngineUpAndBreakerState: pdq_engine_up is 1 only while the breaker is
// closed, never a fraction, and pdq_engine_breaker_state has one series per
// state, 1 for the breaker's.
func TestEngineUpAndBreakerState(t *testing.T) {
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	const engine = "http://10.0.0.7:8200"
	for _, c := range []struct {
		state BreakerState
		up    float64
	}{{BreakerClosed, 1}, {BreakerHalfOpen, 0}, {BreakerOpen, 0}, {BreakerHalfOpen, 0}, {BreakerClosed, 1}} {
		m.EngineUp(StageDecode, engine, c.state)
		if got := testutil.ToFloat64(m.engineUp.WithLabelValues("decode", engine)); got != c.up {
			t.Errorf("breaker %s: pdq_engine_up = %v, want %v", c.state, got, c.up)
		}
		for _, s := range []BreakerState{BreakerClosed, BreakerHalfOpen, BreakerOpen} {
			want := 0.0
			if s == c.state {
				want = 1
			}
			if got := testutil.ToFloat64(m.breakerState.WithLabelValues("decode", engine, string(s))); got != want {
				t.Errorf("breaker %s: pdq_engine_breaker_state{state=%q} = %v, want %v", c.state, s, got, want)
			}
		}
	}
}

// TestGatewayGauges: the requests and bytes a gateway holds go up and back
// down to zero.
func TestGatewayGauges(t *testing.T) {
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	one, two := m.GatewayRequest(), m.GatewayRequest()
	m.GatewayBytes(1000)
	m.GatewayBytes(24)
	if r, b := testutil.ToFloat64(m.gatewayRequests), testutil.ToFloat64(m.gatewayBytes); r != 2 || b != 1024 {
		t.Errorf("two requests of 1024 bytes held: pdq_gateway_inflight_requests = %v, _bytes = %v", r, b)
	}
	one()
	two()
	m.GatewayBytes(-1024)
	if r, b := testutil.ToFloat64(m.gatewayRequests), testutil.ToFloat64(m.gatewayBytes); r != 0 || b != 0 {
		t.Errorf("all given back: pdq_gateway_inflight_requests = %v, _bytes = %v", r, b)
	}
	var none *Metrics
	none.GatewayRequest()()
	none.GatewayBytes(1)
}
