package workers

import (
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

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
		state dispatcher.BreakerState
		up    float64
	}{{dispatcher.BreakerClosed, 1}, {dispatcher.BreakerHalfOpen, 0}, {dispatcher.BreakerOpen, 0}, {dispatcher.BreakerHalfOpen, 0}, {dispatcher.BreakerClosed, 1}} {
		m.EngineUp(dispatcher.StageDecode, engine, c.state)
		if got := testutil.ToFloat64(m.engineUp.WithLabelValues("decode", engine)); got != c.up {
			t.Errorf("breaker %s: pdq_engine_up = %v, want %v", c.state, got, c.up)
		}
		for _, s := range []dispatcher.BreakerState{dispatcher.BreakerClosed, dispatcher.BreakerHalfOpen, dispatcher.BreakerOpen} {
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
