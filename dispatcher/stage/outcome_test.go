package stage

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
)

// TestOutcomeOf: how the handler's error and its job's cause make an
// outcome; a job that succeeded stays a success when its client left,
// unless nobody will decode the handoff it produced.
func TestOutcomeOf(t *testing.T) {
	failed := errors.New("engine exploded")
	cut := fmt.Errorf("relay: %w", context.Canceled)
	for _, tc := range []struct {
		name            string
		err, cause      error
		handedOff, stop bool
		want            verdict.Outcome
	}{
		{"success", nil, nil, false, false, verdict.OK},
		{"success after the client left", nil, errCancelled, false, false, verdict.OK},
		{"a handoff after the client left", nil, errCancelled, true, false, verdict.Stopped},
		{"a handoff after the deadline", nil, errExpired, true, false, verdict.Expired},
		{"cancelled", failed, errCancelled, false, false, verdict.Stopped},
		{"gateway gone", failed, errGatewayGone, false, false, verdict.Stopped},
		{"deadline", failed, errExpired, false, false, verdict.Expired},
		{"abandoned", cut, reply.ErrAbandoned, false, false, verdict.Abandoned},
		{"superseded", cut, reply.ErrSuperseded, false, false, verdict.Superseded},
		{"a lease lost mid-call", cut, errLeaseTaken, false, false, verdict.Superseded},
		{"cut off past the stall time-out", cut, errCutOff, false, false, verdict.Superseded},
		{"a handoff as its lease was lost", nil, errLeaseTaken, true, false, verdict.Superseded},
		{"success as its lease was lost", nil, errLeaseTaken, false, false, verdict.OK},
		{"shutdown", failed, errors.New("grace over"), false, true, verdict.Interrupted},
		{"failed", failed, nil, false, false, verdict.Failed},
	} {
		if got := outcomeOf(tc.err, tc.cause, tc.handedOff, tc.stop); got != tc.want {
			t.Errorf("%s: outcome %d, want %d", tc.name, got, tc.want)
		}
	}
}
