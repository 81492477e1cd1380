package dispatchertest

import (
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Registered is a prometheus.Registerer that keeps what is registered, so
// that a test can describe every metric, one with no series yet too
// (a registry gathers only series).
type Registered []prometheus.Collector

func (r *Registered) Register(c prometheus.Collector) error   { *r = append(*r, c); return nil }
func (r *Registered) MustRegister(cs ...prometheus.Collector) { *r = append(*r, cs...) }
func (r *Registered) Unregister(prometheus.Collector) bool    { return false }

var desc = regexp.MustCompile(`fqName: "([a-z0-9_]+)".*variableLabels: \{([a-z0-9_,]*)\}`)

// Labels are the registered metrics, histograms by their base name, with
// their labels.
func (r Registered) Labels(t testing.TB) map[string][]string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 64)
	go func() {
		for _, c := range r {
			c.Describe(ch)
		}
		close(ch)
	}()
	metrics := map[string][]string{}
	for d := range ch {
		s := desc.FindStringSubmatch(d.String())
		if s == nil {
			t.Fatalf("cannot read the metric description %s", d)
		}
		metrics[s[1]] = []string{}
		if s[2] != "" {
			metrics[s[1]] = strings.Split(s[2], ",")
		}
	}
	return metrics
}

// Value is the value of the counter or gauge name's series whose label
// values are values, in order, as reg exports it; it ends the test when
// there is none.
func Value(t testing.TB, reg prometheus.Gatherer, name string, values ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(values) {
				continue
			}
			for i, l := range m.GetLabel() {
				if l.GetValue() != values[i] {
					continue series
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no series %s%q", name, values)
	return 0
}
