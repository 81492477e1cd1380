package dispatcher

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
)

// The running query (RunningSubject): a stage loop answers it while it
// runs a delivery of the job it names. A stage loop asks it of a job
// redelivered while its first delivery may still run; a gateway asks the
// decode loops whether the decode it heard from still runs (DecodeBeating).

// HeaderBeating on a running query asks only about decode deliveries that
// have beaten to their gateway for at least the milliseconds it holds: a
// delivery that beats runs its handler, which beats from its start (at
// once with Job.ReplyStart) to its return. A loop of a build before it
// answers for any delivery it holds of the job.
const HeaderBeating = "Pdq-Beating"

// DecodeBeating asks the decode stage loops whether a delivery of request
// id's generation has beaten to its gateway for at least since: a decode
// that runs, and whose beats the gateway should have heard. It waits at
// most wait for an answer; none (no delivery of the job runs its handler:
// it waits in the queue, or its worker is gone; or NATS lost the question
// or its answer) is false.
func DecodeBeating(ctx context.Context, nc *nats.Conn, id string, generation int, since, wait time.Duration) bool {
	m := nats.NewMsg(RunningSubject(id))
	m.Header[HeaderGeneration] = []string{strconv.Itoa(generation)}
	m.Header[HeaderStage] = []string{string(StageDecode)}
	m.Header[HeaderBeating] = []string{strconv.FormatInt(since.Milliseconds(), 10)}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	_, err := nc.RequestMsgWithContext(ctx, m)
	return err == nil
}
