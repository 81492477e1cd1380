package tests

import (
	"bytes"
	"fmt"
	"io"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"text/template"

	promodel "github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"gopkg.in/yaml.v3"
)

// The alert rules are checked here as promtool check rules checks them
// (the YAML strictly, each expression parsed by Prometheus's own PromQL
// parser, durations, labels, annotation templates), and then against pdq:
// every metric and label they select is one pdq exports, and they are the
// table of metrics to alert on in docs/operations.md, row for rule.
// Prometheus's rulefmt package would do the first half, but it brings in
// the PromQL engine, OpenTelemetry and client-go; the parser alone is a
// few small packages, and only this test imports it.

// ruleFile is Prometheus's rule file format, every field it knows.
type ruleFile struct {
	Groups []struct {
		Name        string            `yaml:"name"`
		Interval    string            `yaml:"interval"`
		QueryOffset string            `yaml:"query_offset"`
		Limit       int               `yaml:"limit"`
		Labels      map[string]string `yaml:"labels"`
		Rules       []alertRule       `yaml:"rules"`
	} `yaml:"groups"`
}

type alertRule struct {
	Alert         string            `yaml:"alert"`
	Record        string            `yaml:"record"`
	Expr          string            `yaml:"expr"`
	For           string            `yaml:"for"`
	KeepFiringFor string            `yaml:"keep_firing_for"`
	Labels        map[string]string `yaml:"labels"`
	Annotations   map[string]string `yaml:"annotations"`
}

// promql parses PromQL as Prometheus does, with its default features.
var promql = parser.NewParser(parser.Options{})

// labelName is a Prometheus label name as the classic (not UTF-8) rules
// have it, which every Prometheus takes.
var labelName = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)

// selectors are the series selectors of expr, by their metric's name.
func selectors(expr parser.Expr) []*parser.VectorSelector {
	var sels []*parser.VectorSelector
	parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			sels = append(sels, vs)
		}
		return nil
	})
	return sels
}

// checkSelectors reports, through errorf, each selector of expr that names
// a metric pdq does not export, or a label that metric does not have. It
// returns the base names (a histogram's, for its _bucket, _count and _sum
// series) of the metrics it selects.
func checkSelectors(expr parser.Expr, exported map[string][]string, errorf func(string, ...any)) map[string]bool {
	used := map[string]bool{}
	for _, vs := range selectors(expr) {
		name := vs.Name
		base, ok := name, false
		if _, ok = exported[name]; !ok {
			for _, suffix := range []string{"_bucket", "_count", "_sum"} {
				if b, cut := strings.CutSuffix(name, suffix); cut {
					if _, ok = exported[b]; ok {
						base = b
						break
					}
				}
			}
		}
		if !ok {
			errorf("selects %s, which pdq does not export", name)
			continue
		}
		used[base] = true
		for _, m := range vs.LabelMatchers {
			if m.Name == promodel.MetricNameLabel {
				continue
			}
			if m.Name == "le" && base != name && strings.HasSuffix(name, "_bucket") {
				continue
			}
			if !slices.Contains(exported[base], m.Name) {
				errorf("selects %s by the label %s, which it does not have (it has %v)", name, m.Name, exported[base])
			}
		}
	}
	return used
}

// alertTemplate parses an annotation as Prometheus expands it: a Go
// template with $labels, $value and Prometheus's functions, run on
// made-up labels.
func alertTemplate(text string) error {
	funcs := template.FuncMap{}
	for _, f := range []string{"humanize", "humanize1024", "humanizeDuration", "humanizePercentage", "humanizeTimestamp",
		"toUpper", "toLower", "title", "first", "label", "value", "query", "sortByLabel", "graphLink", "tableLink",
		"pathPrefix", "externalURL", "match", "reReplaceAll", "args", "safeHtml", "stripPort", "stripDomain", "toTime",
		"parseDuration", "strvalue", "humanizeRatio"} {
		funcs[f] = func(v ...any) string { return fmt.Sprint(v...) }
	}
	const header = "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$externalURL := .ExternalURL}}{{$value := .Value}}"
	tmpl, err := template.New("annotation").Option("missingkey=zero").Funcs(funcs).Parse(header + text)
	if err != nil {
		return err
	}
	return tmpl.Execute(io.Discard, map[string]any{"Labels": map[string]string{"stage": "decode"},
		"ExternalLabels": map[string]string{}, "ExternalURL": "", "Value": 0.5})
}

// readRules reads deploy/prometheus/pdq-alerts.yaml strictly: a field
// Prometheus does not know fails the test, as it fails Prometheus.
func readRules(t *testing.T) ruleFile {
	t.Helper()
	raw, err := os.ReadFile(repoRoot + "/deploy/prometheus/pdq-alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	var rf ruleFile
	if err := dec.Decode(&rf); err != nil {
		t.Fatalf("pdq-alerts.yaml is not a Prometheus rule file: %v", err)
	}
	if err := dec.Decode(new(any)); err != io.EOF {
		t.Fatalf("pdq-alerts.yaml holds more than one YAML document (%v)", err)
	}
	return rf
}

// TestAlertRules: deploy/prometheus/pdq-alerts.yaml is a rule file
// Prometheus loads, and its alerts select what pdq exports.
func TestAlertRules(t *testing.T) {
	rf := readRules(t)
	exported := metricLabels(t)
	if len(rf.Groups) == 0 {
		t.Fatal("no rule groups")
	}
	groups, alerts := map[string]bool{}, map[string]bool{}
	validName := regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)
	for _, g := range rf.Groups {
		if g.Name == "" || groups[g.Name] {
			t.Errorf("group %q: a group needs a name of its own", g.Name)
		}
		groups[g.Name] = true
		for _, d := range []string{g.Interval, g.QueryOffset} {
			if _, err := promodel.ParseDuration(d); d != "" && err != nil {
				t.Errorf("group %s: %v", g.Name, err)
			}
		}
		if len(g.Rules) == 0 {
			t.Errorf("group %s has no rules", g.Name)
		}
		for _, r := range g.Rules {
			errorf := func(format string, args ...any) {
				t.Helper()
				t.Errorf("alert %s: %s", r.Alert, fmt.Sprintf(format, args...))
			}
			if r.Record != "" || !validName.MatchString(r.Alert) {
				errorf("want an alert rule with a valid name (record %q)", r.Record)
			}
			if alerts[r.Alert] {
				errorf("named twice")
			}
			alerts[r.Alert] = true
			for _, d := range []string{r.For, r.KeepFiringFor} {
				if _, err := promodel.ParseDuration(d); d != "" && err != nil {
					errorf("%v", err)
				}
			}
			expr, err := promql.ParseExpr(r.Expr)
			if err != nil {
				errorf("expr does not parse: %v", err)
				continue
			}
			if expr.Type() != parser.ValueTypeVector {
				errorf("expr is a %s, want an instant vector", expr.Type())
			}
			if len(checkSelectors(expr, exported, errorf)) == 0 {
				errorf("expr selects no pdq metric")
			}
			for name := range r.Labels {
				if !labelName.MatchString(name) {
					errorf("label %q is not a label name", name)
				}
			}
			if s := r.Labels["severity"]; s != "critical" && s != "warning" {
				errorf("severity %q, want critical or warning", s)
			}
			for _, want := range []string{"summary", "description", "runbook"} {
				if r.Annotations[want] == "" {
					errorf("no %s annotation", want)
				}
			}
			if rb := r.Annotations["runbook"]; rb != "" && rb != "docs/operations.md#metrics" {
				errorf("runbook %q, want docs/operations.md#metrics, where its row is", rb)
			}
			for _, key := range slices.Sorted(maps.Keys(r.Annotations)) {
				if err := alertTemplate(r.Annotations[key]); err != nil {
					errorf("annotation %s: %v", key, err)
				}
			}
		}
	}
}

// alertTable is the table of metrics to alert on in docs/operations.md:
// each row's alert, and the selectors its first column names.
func alertTable(t *testing.T) map[string][]string {
	t.Helper()
	raw, err := os.ReadFile(repoRoot + "/docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	start := strings.Index(doc, "The ones to alert on")
	if start < 0 {
		t.Fatal(`docs/operations.md has no "The ones to alert on"`)
	}
	rows := map[string][]string{}
	code := regexp.MustCompile("`([^`]+)`")
	inTable := false
	for _, line := range strings.Split(doc[start:], "\n") {
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) < 4 || strings.HasPrefix(strings.TrimSpace(cells[0]), "---") || strings.TrimSpace(cells[0]) == "watch" {
			continue
		}
		alert := code.FindStringSubmatch(cells[len(cells)-1])
		if alert == nil {
			t.Errorf("the row %q names no alert in its last column", strings.TrimSpace(cells[0]))
			continue
		}
		if rows[alert[1]] != nil {
			t.Errorf("the alert %s has two rows", alert[1])
		}
		for _, m := range code.FindAllStringSubmatch(cells[0], -1) {
			rows[alert[1]] = append(rows[alert[1]], m[1])
		}
		if len(rows[alert[1]]) == 0 {
			t.Errorf("the row of %s names no metric", alert[1])
		}
	}
	if len(rows) == 0 {
		t.Fatal("docs/operations.md's alert table has no rows")
	}
	return rows
}

// TestAlertRulesMatchOperations: the alert rules are the table of
// docs/operations.md, row for rule: each row names an alert of the file,
// each alert has a row, and the alert selects the metrics its row names,
// with the row's labels, and no others.
func TestAlertRulesMatchOperations(t *testing.T) {
	rules := map[string]alertRule{}
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			rules[r.Alert] = r
		}
	}
	exported := metricLabels(t)
	table := alertTable(t)
	for alert, watched := range table {
		r, ok := rules[alert]
		if !ok {
			t.Errorf("docs/operations.md names the alert %s, which pdq-alerts.yaml does not have", alert)
			continue
		}
		expr, err := promql.ParseExpr(r.Expr)
		if err != nil {
			continue // TestAlertRules says why
		}
		used := checkSelectors(expr, exported, func(string, ...any) {})
		want := map[string]bool{}
		for _, w := range watched {
			matchers, err := promql.ParseMetricSelector(w)
			if err != nil {
				t.Errorf("the row of %s names %q, not a series selector: %v", alert, w, err)
				continue
			}
			var name string
			for _, m := range matchers {
				if m.Name == promodel.MetricNameLabel {
					name = m.Value
				}
			}
			want[name] = true
			// The rule selects the metric with every matcher of the row.
			found := false
			for _, vs := range selectors(expr) {
				if vs.Name != name && vs.Name != name+"_bucket" && vs.Name != name+"_count" && vs.Name != name+"_sum" {
					continue
				}
				all := true
				for _, m := range matchers {
					all = all && (m.Name == promodel.MetricNameLabel ||
						slices.ContainsFunc(vs.LabelMatchers, func(o *labels.Matcher) bool { return o.String() == m.String() }))
				}
				found = found || all
			}
			if !found {
				t.Errorf("the row of %s watches %s; the rule's expr does not select it: %s", alert, w, r.Expr)
			}
		}
		if !maps.Equal(used, want) {
			t.Errorf("the alert %s selects %v; its row in docs/operations.md names %v", alert, slices.Sorted(maps.Keys(used)), slices.Sorted(maps.Keys(want)))
		}
	}
	for alert := range rules {
		if table[alert] == nil {
			t.Errorf("the alert %s has no row in docs/operations.md's table", alert)
		}
	}
}
