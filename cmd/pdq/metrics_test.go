package main

import (
	"regexp"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/workers"
)

// registered is a prometheus.Registerer that keeps the names of what is
// registered, so that a test can compare sets, vectors with no series too.
type registered []string

var fqName = regexp.MustCompile(`fqName: "([a-z0-9_]+)"`)

func (r *registered) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			*r = append(*r, m[1])
		}
	}
	return nil
}
func (r *registered) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = r.Register(c)
	}
}
func (r *registered) Unregister(prometheus.Collector) bool { return false }

// TestEveryProcessRegistersEveryMetric: pdq's processes register every
// component's metrics (the gateway's, the workers' and the shared ones) and
// pdq_build_info, so that each exports the same series whatever it runs.
func TestEveryProcessRegistersEveryMetric(t *testing.T) {
	var got, want registered
	if _, err := newMetrics(&got); err != nil {
		t.Fatal(err)
	}
	shared, err := dispatcher.NewMetrics(&want)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gateway.NewMetrics(&want, shared); err != nil {
		t.Fatal(err)
	}
	if _, err := stage.NewMetrics(&want, shared); err != nil {
		t.Fatal(err)
	}
	if _, err := workers.NewMetrics(&want); err != nil {
		t.Fatal(err)
	}
	want = append(want, "pdq_build_info")
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("a process registers %q;\nwant %q", got, want)
	}
}
