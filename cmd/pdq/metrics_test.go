package main

import (
	"maps"
	"slices"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/gateway"
	"github.com/pdq-dev/pdq/workers"
)

// TestEveryProcessRegistersEveryMetric: pdq's processes register every
// component's metrics (the gateway's, the stage loops', the engines' and
// the shared ones) and pdq_build_info, so that each exports the same
// series whatever it runs.
func TestEveryProcessRegistersEveryMetric(t *testing.T) {
	var got, want dispatchertest.Registered
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
	gotNames := slices.Sorted(maps.Keys(got.Labels(t)))
	wantNames := append(slices.Sorted(maps.Keys(want.Labels(t))), "pdq_build_info")
	slices.Sort(wantNames)
	if !slices.Equal(gotNames, wantNames) {
		t.Errorf("a process registers %q;\nwant %q", gotNames, wantNames)
	}
}
