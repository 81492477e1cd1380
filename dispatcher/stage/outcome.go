package stage

import (
	"context"
	"errors"

	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
)

// outcomeOf is how a handler that returned err ended, given its job
// context's cause, whether it produced a handoff, and whether the loop is
// shutting down. A job that succeeded counts as such even when its client
// left meanwhile, unless it produced a handoff that nobody will decode.
func outcomeOf(err, cause error, handedOff, shutdown bool) verdict.Outcome {
	stoppedBy := errors.Is(cause, errCancelled) || errors.Is(cause, errGatewayGone)
	expired := errors.Is(cause, errExpired)
	// A beat's answer stops a decode only if the handler ended by it: one
	// that came as the handler ended the reply itself (a beat racing its
	// end) leaves the handler's own outcome to settle.
	cutOff := errors.Is(err, context.Canceled)
	switch {
	case err == nil && handedOff && expired:
		return verdict.Expired
	case err == nil && handedOff && stoppedBy:
		return verdict.Stopped
	case err == nil && handedOff && errors.Is(cause, reply.ErrSuperseded):
		// Its lease lost as the prefill ended: another delivery runs it.
		return verdict.Superseded
	case err == nil:
		return verdict.OK
	case stoppedBy:
		return verdict.Stopped
	case expired:
		return verdict.Expired
	case cutOff && errors.Is(cause, reply.ErrAbandoned):
		return verdict.Abandoned
	case cutOff && errors.Is(cause, reply.ErrSuperseded):
		return verdict.Superseded
	case shutdown:
		return verdict.Interrupted
	}
	return verdict.Failed
}
