package stage

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestSettleTable holds the settle table to the rows an operator asks
// about: for each kind of delivery and each way its handler can end, the
// verdict, and so (through effects) what becomes of the message, the
// record, the client, the KV and the dead letter.
func TestSettleTable(t *testing.T) {
	prefill := facts{stage: dispatcher.StagePrefill, attempt: 1, maxDeliver: 3, handBacks: true, ran: true}
	decode := facts{stage: dispatcher.StageDecode, handoff: true, attempt: 1, maxDeliver: 3, handBacks: true, ran: true}
	with := func(f facts, change func(*facts)) facts { change(&f); return f }
	fail := func(fl *Failure) func(*facts) { return func(f *facts) { f.failure = fl } }
	engine502 := openai.NewError(502, "engine failed")
	rows := []struct {
		name    string
		f       facts
		o       outcome
		act     action
		release bool
		status  int // the client's, for a fail
		answer  bool
	}{
		{"a prefill that ran", with(prefill, func(f *facts) { f.handedOff = true }), outcomeOK, actAck, false, 0, false},
		{"a decode that answered", decode, outcomeOK, actAck, false, 0, false},
		{"a decode moved to another engine", with(decode, func(f *facts) { f.moved = true }), outcomeOK, actMigrate, false, 0, false},
		{"a prefill whose client left as it ran", with(prefill, func(f *facts) { f.handedOff = true }), outcomeStopped, actStop, true, 0, false},
		{"a prefill past its deadline as it ran", with(prefill, func(f *facts) { f.handedOff = true }), outcomeExpired, actExpire, true, 0, false},
		{"a decode cancelled by its client", decode, outcomeStopped, actStop, false, 0, false},
		{"a decode whose gateway dropped the request", decode, outcomeAbandoned, actStop, false, 0, false},
		{"a decode past its deadline", decode, outcomeExpired, actExpire, false, 0, false},
		{"a decode a later attempt took over", decode, outcomeSuperseded, actNothing, false, 0, false},
		{"shutdown mid-answer", with(decode, func(f *facts) { f.sent = true }), outcomeInterrupted, actFail, false, 502, true},
		{"shutdown before the decode engine ran", with(decode, func(f *facts) { f.ran = false }), outcomeInterrupted, actUnrun, false, 0, false},
		{"shutdown while the decode engine ran", decode, outcomeInterrupted, actRegenerate, false, 0, false},
		{"shutdown while a prefill ran", prefill, outcomeInterrupted, actNak, false, 0, false},
		{"a prefill engine failing (retryable)", with(prefill, fail(&Failure{Client: engine502})), outcomeFailed, actRetry, false, 0, false},
		{"a prefill failing on its last delivery", with(prefill, func(f *facts) { f.attempt, f.failure = 3, &Failure{Client: engine502} }),
			outcomeFailed, actFail, false, 502, true},
		{"a permanent failure", with(prefill, fail(&Failure{Permanent: true, Client: openai.NewError(400, "bad")})), outcomeFailed, actFail, false, 400, true},
		{"a permanent failure the handler answered", with(decode, fail(&Failure{Permanent: true, Reported: true, Client: engine502})),
			outcomeFailed, actFail, false, 502, false},
		{"a decode engine that refused before reading", with(decode, fail(&Failure{Permanent: true, Rejected: true, Client: openai.NewError(400, "too long")})),
			outcomeFailed, actFail, true, 400, true},
		{"a busy engine hands the job back", with(decode, fail(&Failure{HandBack: true})), outcomeFailed, actHandBack, false, 0, false},
		{"no hand-backs left", with(prefill, func(f *facts) { f.handBacks, f.failure = false, &Failure{HandBack: true} }), outcomeFailed, actRetry, false, 0, false},
		{"a decode failing mid-answer", with(decode, func(f *facts) { f.sent, f.failure = true, &Failure{HandBack: true} }), outcomeFailed, actFail, false, 502, true},
		{"a decode failing before its engine ran", with(decode, fail(&Failure{Unread: true})), outcomeFailed, actRegenerate, true, 0, false},
		{"a decode failing before output", decode, outcomeFailed, actRegenerate, false, 0, false},
		{"a decode-only job failing", with(decode, func(f *facts) { f.handoff = false }), outcomeFailed, actRetry, false, 0, false},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			v := decide(r.f, r.o, "engine exploded")
			if v.act != r.act || v.release != r.release || v.answer != r.answer {
				t.Fatalf("verdict %s (release %v, answer %v); want %s (release %v, answer %v)", v.act, v.release, v.answer, r.act, r.release, r.answer)
			}
			if r.act == actFail && (v.client == nil || v.client.Status() != r.status) {
				t.Errorf("the client gets %v; want status %d", v.client, r.status)
			}
			if v.act == actRegenerate && v.waste == "" {
				t.Error("a regeneration that does not say why its prefill was wasted")
			}
		})
	}
	for _, a := range []action{actAck, actMigrate, actStop, actExpire, actNothing, actFail, actHandBack, actRegenerate, actRetry, actUnrun, actNak} {
		if e, ok := effects[a]; !ok || e.msg == "" || e.record == "" || e.client == "" || e.kv == "" || e.dlq == "" {
			t.Errorf("the effects of %q are not all said: %+v", a, e)
		}
	}
}

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
		want            outcome
	}{
		{"success", nil, nil, false, false, outcomeOK},
		{"success after the client left", nil, errCancelled, false, false, outcomeOK},
		{"a handoff after the client left", nil, errCancelled, true, false, outcomeStopped},
		{"a handoff after the deadline", nil, errExpired, true, false, outcomeExpired},
		{"cancelled", failed, errCancelled, false, false, outcomeStopped},
		{"gateway gone", failed, errGatewayGone, false, false, outcomeStopped},
		{"deadline", failed, errExpired, false, false, outcomeExpired},
		{"abandoned", cut, reply.ErrAbandoned, false, false, outcomeAbandoned},
		{"superseded", cut, reply.ErrSuperseded, false, false, outcomeSuperseded},
		{"shutdown", failed, errors.New("grace over"), false, true, outcomeInterrupted},
		{"failed", failed, nil, false, false, outcomeFailed},
	} {
		if got := outcomeOf(tc.err, tc.cause, tc.handedOff, tc.stop); got != tc.want {
			t.Errorf("%s: outcome %d, want %d", tc.name, got, tc.want)
		}
	}
}
