package pull

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/queues"
)

// A loop with affinity (see dispatcher.Job.Preferred) takes, while it
// has a free engine slot, the jobs of the consumers its pool's report
// names stuck (queues.Stuck): on listings queues.StuckAfter apart or more,
// jobs in them (never delivered, or delivered and not acked: a redelivery
// waits among those), no pull waiting on them, and nothing delivered from
// them for StuckAfter: their engine is busy with all it can run, or gone;
// or their next job stored StuckAfter ago or more, no pull waiting: their
// engine delivers, but takes less than comes for it. An engine briefly
// without a pull waiting (its decode gate closed for a look after a job
// it just took) is not taken from. A take-over pull that finds only
// running jobs comes back empty after TakeOverWait.
//
// One worker of the pool lists the consumers and publishes the report
// (dispatcher/queues): every TakeOverEvery while jobs wait or run,
// slowing to queues.IdleEvery while all is idle. Its loop looks at each
// report as it comes (queues.Watch.News).
const TakeOverEvery = queues.BusyEvery

// TakeOverWait is a take-over pull's wait: the job seen waiting may have
// been taken by its own engine meanwhile, and a pull left waiting on
// another engine's consumer would compete with that engine for its next.
const TakeOverWait = 20 * time.Millisecond

// orphanEvery is how often a loop looks for jobs that prefer an engine
// without a consumer (see AdoptOrphans), when the pool's reporter does not
// (queues.Report.Adopts): such jobs count in no consumer, so no report
// names them. While none waits it is one stream info request, filtered
// to the pool's preferred subjects.
const orphanEvery = time.Second

// TakeOver finds, for one loop, the engines' consumers it is to
// take jobs from, so that affinity never leaves its engine idle while
// work waits for another. Its loop calls it, one call at a time.
type TakeOver struct {
	js      jetstream.JetStream
	watch   *queues.Watch // the pool's queues of the loop's stage
	stage   dispatcher.Stage
	pool    string
	own     string // the loop's own engine consumer, never taken from
	ackWait time.Duration
	log     *slog.Logger

	adopted time.Time                     // when AdoptOrphans last ran here
	every   time.Duration                 // the longest wait before the next look (Every)
	last    *queues.Report                // the report of the last look
	handles map[string]jetstream.Consumer // the stuck consumers of the last report, by name
}

// Stuck is a consumer to take jobs from, and how many it held.
type Stuck struct {
	Consumer jetstream.Consumer
	Jobs     int
}

// NewTakeOver makes the take-over of the loop of stage and pool whose
// engine's key is engine (see dispatcher.EngineKey), reading watch, the
// pool's queues of stage. ackWait is the ack
// wait of the consumers it makes for orphaned jobs.
func NewTakeOver(js jetstream.JetStream, watch *queues.Watch, stage dispatcher.Stage, pool, engine string, ackWait time.Duration, log *slog.Logger) *TakeOver {
	return &TakeOver{js: js, watch: watch, stage: stage, pool: pool, own: dispatcher.EngineConsumerName(stage, pool, engine),
		ackWait: ackWait, log: log, every: TakeOverEvery, handles: map[string]jetstream.Consumer{}}
}

// Every is the longest its loop waits before the next look, should no
// report come before (watch.News): the next report's time, or
// TakeOverEvery while the loop's engine is full (a slot that frees makes
// the last report worth reading again) or no report could be read.
func (t *TakeOver) Every() time.Duration { return t.every }

// Look returns the consumers to take jobs from now: those the pool's last
// report names stuck, but for the loop's own; none while the loop's
// engine has no slot free (full), nor twice for one report. Every
// orphanEvery, unless the reporter does it (queues.Report.Adopts), it
// first gives a consumer to jobs whose engine has none. With NATS away it
// finds none.
func (t *TakeOver) Look(ctx context.Context, full bool) []Stuck {
	r, err := t.watch.Latest(ctx, TakeOverEvery)
	if err != nil {
		t.every = TakeOverEvery
		return nil // the next look
	}
	t.every = max(time.Duration(r.NextMs)*time.Millisecond, TakeOverEvery)
	if !r.Adopts && time.Since(t.adopted) >= orphanEvery {
		t.adopted = time.Now()
		AdoptOrphans(ctx, t.js, t.stage, t.pool, t.ackWait, t.log)
	}
	if full {
		t.every = TakeOverEvery
		return nil // nothing to take it with
	}
	if r == t.last {
		return nil // nothing new
	}
	t.last = r
	var take []Stuck
	handles := map[string]jetstream.Consumer{} // those this report names, kept for the next
	for _, s := range r.Stuck {
		if s.Consumer == t.own {
			continue
		}
		cons := t.handles[s.Consumer]
		if cons == nil {
			// One consumer info, at the first report that names it stuck.
			if cons, err = t.js.Consumer(ctx, dispatcher.StageStream(t.stage), s.Consumer); err != nil {
				continue
			}
		}
		handles[s.Consumer] = cons
		take = append(take, Stuck{Consumer: cons, Jobs: s.Jobs})
	}
	t.handles = handles
	return take
}

// AdoptOrphans gives a consumer to the jobs of stage and pool that prefer
// an engine which has none: an engine that left before it ever pulled, or
// whose consumer was removed as idle. Those jobs would otherwise wait for
// nobody; with a consumer, they are taken over like any others of a gone
// engine. ackWait is the consumers'. The pool's reporter runs it
// (queues.Options.Adopt), or each loop with affinity when the reporter
// does not.
func AdoptOrphans(ctx context.Context, js jetstream.JetStream, stage dispatcher.Stage, pool string, ackWait time.Duration, log *slog.Logger) {
	st, err := js.Stream(ctx, dispatcher.StageStream(stage))
	if err != nil {
		return
	}
	prefix := dispatcher.StageSubject(stage) + "." + pool + "."
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(prefix+"*.*"))
	if err != nil || len(info.State.Subjects) == 0 {
		return
	}
	infos, err := dispatcher.EngineConsumers(ctx, js, stage, pool)
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
		if name := dispatcher.EngineConsumerName(stage, pool, engine); !have[name] {
			if _, err := dispatcher.EnsureEngineConsumer(ctx, js, stage, pool, engine, ackWait, dispatcher.WithLogger(log)); err == nil {
				have[name] = true
				log.Info("jobs wait for an engine without a consumer; gave it one, to take them over", "engine", engine)
			}
		}
	}
}
