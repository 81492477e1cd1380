package tests

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/sim"
)

// natsOutageScenario kills a standalone nats-server (-9) while streamed
// and non-streamed requests run, keeps it down while more arrive, and
// starts it again on the same store. What an outage must not break:
//   - a request that arrives while NATS is down is refused with a 503 and
//     a Retry-After, before NATS is back;
//   - every request in flight at the kill gets one answer before NATS is
//     back (the gateway's stall time-out is 5 s);
//   - once NATS is back, the record of every request of both ends (none
//     is left queued or running), and every id that did not complete is
//     served when sent again: none is left unusable.
func natsOutageScenario(t *testing.T, down time.Duration) row {
	ns, c := standaloneNATS(t)

	// Half streamed, half answered whole; 60 tokens of 50 ms each, so
	// that every decode runs when NATS goes.
	mixed := func(i int) body {
		if i%2 == 0 {
			return streamed(60)(i)
		}
		return answered(60)(i)
	}
	var inFlight, arriving []timed
	inDone, arrDone := make(chan struct{}), make(chan struct{})
	go func() { inFlight = c.timedLoad(12, "no", mixed); close(inDone) }()
	c.decode.WaitStats(t, 10*time.Second, "decodes running", func(s sim.Stats) bool { return s.Running >= 10 })
	time.Sleep(500 * time.Millisecond)
	ns.kill9()
	killed := time.Now()
	waitReady(t, c.url, http.StatusServiceUnavailable, 5*time.Second)
	go func() { arriving = c.timedLoad(8, "nod", mixed); close(arrDone) }()
	time.Sleep(time.Until(killed.Add(down)))
	ns.start()
	restarted := time.Now()
	waitReady(t, c.url, http.StatusOK, 20*time.Second)
	<-inDone
	<-arrDone

	for i, o := range inFlight {
		if o.end.After(restarted) {
			t.Errorf("no-%d, in flight at the kill, was answered %v after NATS came back (%+v); want before, within its stall time-out",
				i, o.end.Sub(restarted).Round(time.Millisecond), o.outcome)
		}
	}
	for i, o := range arriving {
		if o.status != http.StatusServiceUnavailable || o.retryAfter == "" || o.end.After(restarted) {
			t.Errorf("nod-%d, sent while NATS was down: %+v after %v; want a 503 with Retry-After before NATS came back",
				i, o.outcome, o.took.Round(time.Millisecond))
		}
	}
	// Every record ends once NATS is back; a request refused at once may
	// have none.
	var ids []string
	for i := range inFlight {
		ids = append(ids, fmt.Sprintf("no-%d", i))
	}
	for i := range arriving {
		ids = append(ids, fmt.Sprintf("nod-%d", i))
	}
	var unended []string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		unended = unended[:0]
		for _, id := range ids {
			if st := c.record(id).State; st != "" && !st.Ended() {
				unended = append(unended, fmt.Sprintf("%s %s", id, st))
			}
		}
		if len(unended) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(unended) > 0 {
		t.Errorf("records not ended 10 s after NATS came back: %v", unended)
	}
	// Every id that did not complete is served when sent again.
	var retry []string
	for _, g := range []struct {
		prefix string
		ts     []timed
	}{{"no", inFlight}, {"nod", arriving}} {
		for i, o := range g.ts {
			if !o.ok {
				retry = append(retry, fmt.Sprintf("%s-%d", g.prefix, i))
			}
		}
	}
	again := make([]outcome, len(retry))
	var wg sync.WaitGroup
	for i, id := range retry {
		wg.Go(func() { again[i] = c.one(id, 0, mixed(i)) })
	}
	wg.Wait()
	for i, a := range again {
		if !a.ok {
			t.Errorf("%s sent again after the outage: %+v; want it served", retry[i], a)
		}
	}

	r := row{scenario: fmt.Sprintf("NATS down %v (kill -9, restart on its store)", down)}
	tally(&r, append(outcomes(inFlight, arriving), again...))
	r.blocksHeld = c.settle(15 * time.Second)
	var in, refused row
	tally(&in, outcomes(inFlight))
	tally(&refused, outcomes(arriving))
	r.cost = fmt.Sprintf("in flight: %d whole, %d errors; %d refused; %d sent again", in.completed, in.errors, refused.errors, len(again))
	t.Logf("NATS down %v: in flight %d whole, %d errors, %d lost, longest %v; sent while down: %d errors, longest %v",
		restarted.Sub(killed).Round(time.Millisecond), in.completed, in.errors, in.lost, longest(inFlight).Round(time.Millisecond),
		refused.errors, longest(arriving).Round(time.Millisecond))
	return r
}
