package tests

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/workers"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/prometheus/promql/parser"
)

// metricLabels are the metrics pdq registers (the gateway's, the
// workers' and the shared ones), histograms as their base name, with their
// labels; and pdq_build_info, which cmd/pdq registers (TestMetricsCountTraffic
// checks that a live pdq serves it).
func metricLabels(t *testing.T) map[string][]string {
	t.Helper()
	var reg dispatchertest.Registered
	shared, err := dispatcher.NewMetrics(&reg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gateway.NewMetrics(&reg, shared); err != nil {
		t.Fatal(err)
	}
	if _, err := stage.NewMetrics(&reg, shared); err != nil {
		t.Fatal(err)
	}
	if _, err := workers.NewMetrics(&reg); err != nil {
		t.Fatal(err)
	}
	metrics := map[string][]string{"pdq_build_info": {"version", "revision", "goversion"}}
	for name, labels := range reg.Labels(t) {
		if strings.HasPrefix(name, "pdq_") { // not the Go runtime's and the process's own
			metrics[name] = labels
		}
	}
	return metrics
}

// dashboard is deploy/grafana/pdq-dashboard.json, as much as the tests
// read of it.
type dashboard struct {
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

// grafanaVars stand for Grafana's own variables, so that a panel's query
// parses as PromQL.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h")

// TestDashboardQueriesExist: every query of the Grafana dashboard parses
// as PromQL and selects metrics and labels pdq exports, and the dashboard
// shows what issues 8 and 25 ask of it, every metric an alert watches
// among them.
func TestDashboardQueriesExist(t *testing.T) {
	raw, err := os.ReadFile(repoRoot + "/deploy/grafana/pdq-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash dashboard
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	exported := metricLabels(t)
	used := map[string]bool{}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, target := range p.Targets {
			expr, err := promql.ParseExpr(grafanaVars.Replace(target.Expr))
			if err != nil {
				t.Errorf("panel %q: %q does not parse: %v", p.Title, target.Expr, err)
				continue
			}
			maps.Copy(used, checkSelectors(expr, exported, func(format string, args ...any) {
				t.Errorf("panel %q: %s", p.Title, fmt.Sprintf(format, args...))
			}))
		}
	}
	// A variable's query is Grafana's (label_values), not PromQL.
	metric := regexp.MustCompile(`\bpdq_[a-z0-9_]+`)
	for _, v := range dash.Templating.List {
		if q, ok := v.Query.(string); ok {
			for _, name := range metric.FindAllString(q, -1) {
				if exported[name] == nil {
					t.Errorf("a variable queries %s, which pdq does not export", name)
				}
			}
		}
	}
	want := []string{"pdq_requests_total", "pdq_ttft_seconds", "pdq_itl_seconds", "pdq_queue_depth",
		"pdq_queue_wait_seconds", "pdq_retries_total", "pdq_dead_letters_total", "pdq_decode_only_total", "pdq_engine_up",
		"pdq_engine_breaker_state", "pdq_gateway_inflight_requests", "pdq_gateway_inflight_bytes", "pdq_build_info"}
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			if expr, err := promql.ParseExpr(r.Expr); err == nil {
				want = append(want, slices.Collect(maps.Keys(checkSelectors(expr, exported, func(string, ...any) {})))...)
			}
		}
	}
	for _, w := range want {
		if !used[w] {
			t.Errorf("the dashboard does not show %s", w)
		}
	}
}

// TestDashboardDecodeOnlyShare: the decode-only share divides by the
// requests that went to an engine: answered, failed or cancelled, not a
// client's mistake (4xx) nor one turned away (429, 503).
func TestDashboardDecodeOnlyShare(t *testing.T) {
	raw, err := os.ReadFile(repoRoot + "/deploy/grafana/pdq-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash dashboard
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	shares := 0
	for _, p := range dash.Panels {
		for _, target := range p.Targets {
			expr, err := promql.ParseExpr(grafanaVars.Replace(target.Expr))
			if err != nil || !strings.Contains(target.Expr, "pdq_decode_only_total") {
				continue
			}
			parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
				div, ok := n.(*parser.BinaryExpr)
				if !ok || div.Op != parser.DIV || !strings.Contains(div.LHS.String(), "pdq_decode_only_total") {
					return nil
				}
				shares++
				denominators := 0
				for _, vs := range selectors(div.RHS) {
					if vs.Name != "pdq_requests_total" {
						t.Errorf("panel %q divides by %s", p.Title, vs.Name)
						continue
					}
					denominators++
					for outcome, counts := range map[string]bool{"ok": true, "error": true, "cancelled": true, "client_error": false, "rejected": false} {
						matches := true
						for _, m := range vs.LabelMatchers {
							if m.Name == "outcome" {
								matches = matches && m.Matches(outcome)
							}
						}
						if matches != counts {
							t.Errorf("panel %q: the decode-only share's denominator %s counts outcome=%q: %v, want %v", p.Title, vs, outcome, matches, counts)
						}
					}
				}
				if denominators == 0 {
					t.Errorf("panel %q: the decode-only share divides by no count of requests: %s", p.Title, div)
				}
				return nil
			})
		}
	}
	if shares == 0 {
		t.Error("the dashboard has no decode-only share")
	}
}

// TestHistogramBucketsAreRound: every bucket bound is a number an SLO is
// written against (a whole number of milliseconds, two significant digits
// at most), TTFT's are the ones issue 25 names, and each histogram keeps
// few buckets, since every bound is a series per label value.
func TestHistogramBucketsAreRound(t *testing.T) {
	reg := prometheus.NewRegistry()
	shared, err := dispatcher.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	gm, err := gateway.NewMetrics(reg, shared)
	if err != nil {
		t.Fatal(err)
	}
	wm, err := stage.NewMetrics(reg, shared)
	if err != nil {
		t.Fatal(err)
	}
	gm.Request("m", "ok", time.Second, time.Second)
	gm.ITL("m").Observe(0.02)
	wm.JobStarted(dispatcher.StagePrefill, time.Second)
	wm.JobEnded(dispatcher.StagePrefill, time.Second)
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
