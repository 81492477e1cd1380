package pull

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
)

// A loop with affinity (see dispatcher.Job.Preferred) looks every
// TakeOverEvery, while it has a free engine slot, for jobs waiting for
// other engines that cannot take them. A consumer is taken from when two
// looks in a row find jobs in it (never delivered, or delivered and not
// acked: a redelivery waits among those), no pull waiting on it, and
// nothing delivered from it for takeOverAfter: its engine is busy with
// all it can run, or gone; or when two looks in a row find its next job
// stored takeOverAfter ago or more, no pull waiting: its engine delivers,
// but takes less than comes for it. An engine briefly without a pull waiting (its
// decode gate closed for a look after a job it just took) is not taken
// from. A take-over pull that finds only running jobs comes back empty
// after TakeOverWait.
//
// A look lists the stage's consumers (two JetStream API requests, and an
// answer that grows with the engines). While every engine's consumer is
// idle, the looks slow down, doubling up to takeOverIdleEvery: an idle
// fleet of 100 workers made some 2,000 such requests a second, most of
// what its JetStream served (docs/scaling.md). The first look to find a
// job waiting, or an engine's consumer with jobs and no pull, brings
// them back to TakeOverEvery; so at the start of a burst after a quiet
// spell, a job that prefers a full engine may wait up to
// takeOverIdleEvery longer than it would have.
const (
	TakeOverEvery     = 100 * time.Millisecond
	takeOverIdleEvery = 1600 * time.Millisecond
	takeOverAfter     = 100 * time.Millisecond
)

// TakeOverWait is a take-over pull's wait: the job seen waiting may have
// been taken by its own engine meanwhile, and a pull left waiting on
// another engine's consumer would compete with that engine for its next.
const TakeOverWait = 20 * time.Millisecond

// orphanEvery is how often a loop looks for jobs that prefer an engine
// without a consumer (see adoptOrphans), whatever the pace of its looks:
// such jobs count in no consumer, so they never speed the looks up. While
// none waits it is one stream info request, filtered to the pool's
// preferred subjects.
const orphanEvery = time.Second

// TakeOver finds, for one loop, the engines' consumers it is to
// take jobs from, so that affinity never leaves its engine idle while
// work waits for another. Its loop calls it, one call at a time.
type TakeOver struct {
	js      jetstream.JetStream
	stage   dispatcher.Stage
	pool    string
	own     string // the loop's own engine consumer, never taken from
	ackWait time.Duration
	log     *slog.Logger

	adopted time.Time        // when adoptOrphans last ran
	every   time.Duration    // until the next look (Every)
	stuck   map[string]bool  // consumers that looked stuck on the last look
	stream  jetstream.Stream // the stage's, for behind; found at its first use
}

// Stuck is a consumer to take jobs from, and how many it held.
type Stuck struct {
	Consumer jetstream.Consumer
	Jobs     int
}

// NewTakeOver makes the take-over of the loop of stage and pool whose
// engine's key is engine (see dispatcher.EngineKey). ackWait is the ack
// wait of the consumers it makes for orphaned jobs.
func NewTakeOver(js jetstream.JetStream, stage dispatcher.Stage, pool, engine string, ackWait time.Duration, log *slog.Logger) *TakeOver {
	return &TakeOver{js: js, stage: stage, pool: pool, own: dispatcher.EngineConsumerName(stage, pool, engine),
		ackWait: ackWait, log: log, stuck: map[string]bool{}, every: TakeOverEvery}
}

// Every is how long its loop waits before the next look: TakeOverEvery
// after a look that found work waiting in an engine's consumer, or could
// not look; longer after each look that found all idle.
func (t *TakeOver) Every() time.Duration { return t.every }

// paced sets the wait before the next look, after one that found work
// waiting (busy) or not.
func (t *TakeOver) paced(busy bool) {
	if busy {
		t.every = TakeOverEvery
		return
	}
	t.every = min(2*t.every, takeOverIdleEvery)
}

// Look returns the consumers to take jobs from now: those stuck on this
// look and the one before; none while the loop's engine has no slot free
// (full), whose look forgets what was stuck, as there is nothing to take
// it with. Every orphanEvery it first gives a consumer to jobs
// whose engine has none. With NATS away it finds none.
func (t *TakeOver) Look(ctx context.Context, full bool) []Stuck {
	if time.Since(t.adopted) >= orphanEvery {
		t.adopted = time.Now()
		t.adoptOrphans(ctx)
	}
	if full {
		clear(t.stuck)
		t.paced(true) // nothing asked of NATS: the next look as soon as a slot frees
		return nil
	}
	infos, err := dispatcher.EngineConsumers(ctx, t.js, t.stage, t.pool)
	if err != nil {
		t.paced(true)
		return nil // the next look
	}
	next := map[string]bool{}
	var take []Stuck
	busy := false
	for _, info := range infos {
		if info.Name != t.own && info.NumPending > 0 {
			busy = true
		}
		if info.Name == t.own || !stuckConsumer(info) && !t.behind(ctx, info) {
			continue
		}
		busy = true
		if next[info.Name] = true; !t.stuck[info.Name] {
			continue
		}
		cons, err := t.js.Consumer(ctx, info.Stream, info.Name)
		if err != nil {
			continue
		}
		take = append(take, Stuck{Consumer: cons, Jobs: int(info.NumPending) + info.NumAckPending})
	}
	t.stuck = next
	t.paced(busy)
	return take
}

// adoptOrphans gives a consumer to the jobs that prefer an engine which
// has none: an engine that left before it ever pulled, or whose consumer
// was removed as idle. Those jobs would otherwise wait for nobody; with a
// consumer, they are taken over like any others of a gone engine.
func (t *TakeOver) adoptOrphans(ctx context.Context) {
	st, err := t.js.Stream(ctx, dispatcher.StageStream(t.stage))
	if err != nil {
		return
	}
	prefix := dispatcher.StageSubject(t.stage) + "." + t.pool + "."
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(prefix+"*.*"))
	if err != nil || len(info.State.Subjects) == 0 {
		return
	}
	infos, err := dispatcher.EngineConsumers(ctx, t.js, t.stage, t.pool)
	if err != nil {
		return
	}
	have := map[string]bool{}
	for _, c := range infos {
		have[c.Name] = true
	}
	for subject := range info.State.Subjects {
		engine := subject[strings.LastIndexByte(subject, '.')+1:]
		if !dispatcher.IsEngineKey(engine) {
			continue
		}
		if name := dispatcher.EngineConsumerName(t.stage, t.pool, engine); !have[name] {
			if _, err := dispatcher.EnsureEngineConsumer(ctx, t.js, t.stage, t.pool, engine, t.ackWait, dispatcher.WithLogger(t.log)); err == nil {
				have[name] = true
				t.log.Info("jobs wait for an engine without a consumer; gave it one, to take them over", "engine", engine)
			}
		}
	}
}

// behind says whether an engine's consumer delivers, but not fast enough:
// jobs wait undelivered, no pull is waiting (its engine's seats are all
// busy), and the next job to be delivered was stored takeOverAfter ago or
// more. An engine over its capacity that ends a job every few tens of
// milliseconds is never stuck (it delivers), yet its queue grows while
// other engines idle. It reads the next job's stored time: one message
// get, only for such a consumer.
func (t *TakeOver) behind(ctx context.Context, info *jetstream.ConsumerInfo) bool {
	if info.NumPending == 0 || info.NumWaiting > 0 {
		return false
	}
	stored := nextStored(ctx, t.js, &t.stream, info)
	return !stored.IsZero() && info.TimeStamp.Sub(stored) >= takeOverAfter
}

// stuckConsumer says whether an engine's consumer has jobs that its engine
// does not take: pending, or delivered and not acked (NumPending does not
// count a job nak'd, or whose ack wait ran out, to be delivered again),
// with no pull waiting and nothing delivered for takeOverAfter (by the
// server's clock).
func stuckConsumer(info *jetstream.ConsumerInfo) bool {
	if info.NumPending == 0 && info.NumAckPending == 0 || info.NumWaiting > 0 {
		return false
	}
	last := info.Created
	if info.Delivered.Last != nil {
		last = *info.Delivered.Last
	}
	return info.TimeStamp.Sub(last) >= takeOverAfter
}
