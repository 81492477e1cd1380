package verdict

import (
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestSettleTable holds the settle table to the rows an operator asks
// about: for each kind of delivery and each way its handler can end, the
// verdict, and so (through Effects) what becomes of the message, the
// record, the client, the KV and the dead letter.
func TestSettleTable(t *testing.T) {
	prefill := Facts{Stage: dispatcher.StagePrefill, Attempt: 1, MaxDeliver: 3, HandBacks: true, Ran: true}
	decode := Facts{Stage: dispatcher.StageDecode, Handoff: true, Attempt: 1, MaxDeliver: 3, HandBacks: true, Ran: true}
	with := func(f Facts, change func(*Facts)) Facts { change(&f); return f }
	fail := func(fl *Failure) func(*Facts) { return func(f *Facts) { f.Failure = fl } }
	engine502 := openai.NewError(502, "engine failed")
	rows := []struct {
		name    string
		f       Facts
		o       Outcome
		act     Action
		release bool
		status  int // the client's, for a fail
		answer  bool
	}{
		{"a prefill that ran", with(prefill, func(f *Facts) { f.HandedOff = true }), OK, ActAck, false, 0, false},
		{"a decode that answered", decode, OK, ActAck, false, 0, false},
		{"a decode moved to another engine", with(decode, func(f *Facts) { f.Moved = true }), OK, ActMigrate, false, 0, false},
		{"a prefill whose client left as it ran", with(prefill, func(f *Facts) { f.HandedOff = true }), Stopped, ActStop, true, 0, false},
		{"a prefill past its deadline as it ran", with(prefill, func(f *Facts) { f.HandedOff = true }), Expired, ActExpire, true, 0, false},
		{"a decode cancelled by its client", decode, Stopped, ActStop, false, 0, false},
		{"a decode whose gateway dropped the request", decode, Abandoned, ActStop, false, 0, false},
		{"a decode past its deadline", decode, Expired, ActExpire, false, 0, false},
		{"a decode a later attempt took over", decode, Superseded, ActNothing, false, 0, false},
		{"a prefill another delivery took over as it ended", with(prefill, func(f *Facts) { f.HandedOff = true }), Superseded, ActNothing, true, 0, false},
		{"shutdown mid-answer", with(decode, func(f *Facts) { f.Sent = true }), Interrupted, ActFail, false, 502, true},
		{"shutdown before the decode engine ran", with(decode, func(f *Facts) { f.Ran = false }), Interrupted, ActUnrun, false, 0, false},
		{"shutdown while the decode engine ran", decode, Interrupted, ActRegenerate, false, 0, false},
		{"shutdown while a prefill ran", prefill, Interrupted, ActNak, false, 0, false},
		{"a prefill engine failing (retryable)", with(prefill, fail(&Failure{Client: engine502})), Failed, ActRetry, false, 0, false},
		{"a prefill failing on its last delivery", with(prefill, func(f *Facts) { f.Attempt, f.Failure = 3, &Failure{Client: engine502} }),
			Failed, ActFail, false, 502, true},
		{"a permanent failure", with(prefill, fail(&Failure{Permanent: true, Client: openai.NewError(400, "bad")})), Failed, ActFail, false, 400, true},
		{"a permanent failure the handler answered", with(decode, fail(&Failure{Permanent: true, Reported: true, Client: engine502})),
			Failed, ActFail, false, 502, false},
		{"a decode engine that refused before reading", with(decode, fail(&Failure{Permanent: true, Rejected: true, Client: openai.NewError(400, "too long")})),
			Failed, ActFail, true, 400, true},
		{"a busy engine hands the job back", with(decode, fail(&Failure{HandBack: true})), Failed, ActHandBack, false, 0, false},
		{"no hand-backs left", with(prefill, func(f *Facts) { f.HandBacks, f.Failure = false, &Failure{HandBack: true} }), Failed, ActRetry, false, 0, false},
		{"a decode failing mid-answer", with(decode, func(f *Facts) { f.Sent, f.Failure = true, &Failure{HandBack: true} }), Failed, ActFail, false, 502, true},
		{"a decode failing before its engine ran", with(decode, fail(&Failure{Unread: true})), Failed, ActRegenerate, true, 0, false},
		{"a decode failing before output", decode, Failed, ActRegenerate, false, 0, false},
		{"a decode-only job failing", with(decode, func(f *Facts) { f.Handoff = false }), Failed, ActRetry, false, 0, false},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			v := Decide(r.f, r.o, "engine exploded")
			if v.Act != r.act || v.Release != r.release || v.Answer != r.answer {
				t.Fatalf("verdict %s (release %v, answer %v); want %s (release %v, answer %v)", v.Act, v.Release, v.Answer, r.act, r.release, r.answer)
			}
			if r.act == ActFail && (v.Client == nil || v.Client.Status() != r.status) {
				t.Errorf("the client gets %v; want status %d", v.Client, r.status)
			}
			if v.Act == ActRegenerate && v.Waste == "" {
				t.Error("a regeneration that does not say why its prefill was wasted")
			}
		})
	}
	for _, a := range []Action{ActAck, ActMigrate, ActStop, ActExpire, ActNothing, ActFail, ActHandBack, ActRegenerate, ActRetry, ActUnrun, ActNak} {
		if e, ok := Effects(a); !ok || e.Msg == "" || e.Record == "" || e.Client == "" || e.KV == "" || e.DLQ == "" {
			t.Errorf("the effects of %q are not all said: %+v", a, e)
		}
	}
}
