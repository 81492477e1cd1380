package queues

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// A reporter lists its pool's consumers every BusyEvery while jobs wait
// or run; while none does, the listings come further apart, doubling up
// to IdleEvery. So an idle pool costs JetStream one list request every
// 1.6 s, whatever its size; and a job that prefers a full engine at the
// start of a burst after a quiet spell may wait up to IdleEvery longer
// before another engine takes it over.
const (
	BusyEvery = 100 * time.Millisecond
	IdleEvery = 1600 * time.Millisecond
)

// StuckAfter is how long an engine's consumer must have delivered
// nothing, or its next job waited, and then stayed so, to be named stuck
// (see Stuck).
const StuckAfter = 100 * time.Millisecond

// headEvery is how often a consumer's next job is read anew to time its
// wait, while the consumer delivers: a read fetches the whole message,
// prompt included.
const headEvery = 250 * time.Millisecond

// askedFresh is the youngest listing a reporter keeps when asked for a
// fresh one (Fresh): many gates asking at once are answered by one
// listing.
const askedFresh = 25 * time.Millisecond

// Report is what a pool's queues of one stage held at a listing.
type Report struct {
	// By is the id of the watch that listed: the pool's reporter.
	By string `json:"by"`
	// NextMs is how long until its next report, the listing's own time
	// included: a report not followed by another within twice that is
	// stale.
	NextMs int64 `json:"next_ms"`
	// Pending is how many jobs wait undelivered, in the shared consumer
	// and the engines'; Held how many are delivered and not yet acked.
	Pending int `json:"pending"`
	Held    int `json:"held"`
	// Waiting is how many pulls wait on the shared consumer: one a worker
	// with room.
	Waiting int `json:"waiting"`
	// HeadMs is how long the longest-waiting next job of a consumer had
	// waited, by the server's clock (a job waiting to be delivered again
	// is not counted); 0 when none waits or it could not be read.
	HeadMs int64 `json:"head_ms,omitempty"`
	// Shared is the shared consumer's part of Pending and HeadMs: what
	// counts while no worker takes the jobs that prefer its engine.
	Shared Shared `json:"shared"`
	// Stuck are the engines' consumers stuck on this listing and on those
	// before it for StuckAfter: for the pool's other workers to take
	// their jobs over.
	Stuck []Stuck `json:"stuck,omitempty"`
	// Adopts says the reporter gives a consumer to the jobs that prefer
	// an engine without one (Options.Adopt), so the others need not look
	// for them.
	Adopts bool `json:"adopts,omitempty"`

	at time.Time // when this process made or heard it
}

// Stuck is an engine's consumer whose jobs its engine does not take: it
// holds jobs, no pull waits on it, and it has delivered nothing for
// StuckAfter (its engine is busy with all it can run, or gone); or its
// next job has waited StuckAfter (its engine delivers, but takes less
// than comes for it).
type Stuck struct {
	Consumer string `json:"consumer"`
	// Jobs are those waiting and those delivered and not acked (a job
	// to be delivered again waits among the latter).
	Jobs int `json:"jobs"`
}

// Shared is what a report says of the pool's shared consumer.
type Shared struct {
	Pending int   `json:"pending"`
	HeadMs  int64 `json:"head_ms,omitempty"`
	// Missing says the shared consumer was not there (no worker of the
	// pool has started, or it is being made again).
	Missing bool `json:"missing,omitempty"`
}

// Head is how long the shared consumer's next job had waited.
func (s Shared) Head() time.Duration { return time.Duration(s.HeadMs) * time.Millisecond }

// Head is how long the longest-waiting next job had waited.
func (r *Report) Head() time.Duration { return time.Duration(r.HeadMs) * time.Millisecond }

// Busy says whether jobs waited or ran at the listing (a consumer named
// stuck holds some).
func (r *Report) Busy() bool { return r.Pending > 0 || r.Held > 0 }

// Age is how long ago this process made or heard the report.
func (r *Report) Age() time.Duration { return time.Since(r.at) }

// fresh says whether a report is still its reporter's last: the next is
// not overdue (see staleAfter).
func (r *Report) fresh() bool { return r.Age() < staleAfter(time.Duration(r.NextMs)*time.Millisecond) }

// staleAfter is how long a report whose next is due after next stands: a
// listing may come late, once.
func staleAfter(next time.Duration) time.Duration { return 2*next + 250*time.Millisecond }

// announce tells News's readers of a report made or heard. w.mu is held.
func (w *Watch) announce() {
	close(w.news)
	w.news = make(chan struct{})
}

// Options configure a Watch.
type Options struct {
	// ID orders the watches that publish: the first is the reporter. The
	// loop's worker id; empty is a random one.
	ID string
	// Publish lets the watch report for the pool: the pool's own workers
	// of the stage publish, others (a prefill worker's decode gate) only
	// listen.
	Publish bool
	// Adopt, when set, gives a consumer to the jobs that prefer an engine
	// without one; the reporter calls it at most every adoptEvery, from
	// its reporting loop (Report.Adopts).
	Adopt func(ctx context.Context)
	Log   *slog.Logger
}

// adoptEvery is how often a reporter calls Options.Adopt.
const adoptEvery = time.Second

// Watch is one process's view of a pool's queues of one stage. Its
// methods may be called from any goroutine.
type Watch struct {
	js    jetstream.JetStream
	nc    *nats.Conn
	stage dispatcher.Stage
	pool  string
	opts  Options

	// listMu is held across a listing: one at a time. It guards the
	// fields below it.
	listMu sync.Mutex
	stream jetstream.Stream     // the stage's, found at the first listing
	heads  map[string]*head     // consumer → its next job
	since  map[string]time.Time // consumer → when it was first seen stuck, on the listings in a row up to the last
	listed time.Time            // when the last listing was made
	pace   time.Duration        // until the next listing, when reporting
	poke   chan struct{}        // wakes the reporting loop for a listing asked for (Fresh)

	// adopting is set while Options.Adopt runs, on its own goroutine;
	// adopted is when it last ended (unix nanoseconds).
	adopting atomic.Bool
	adopted  atomic.Int64

	// mu guards the fields below.
	mu    sync.Mutex
	heard *Report       // the last report of another, the first-sorting heard
	own   *Report       // this watch's last listing
	asked time.Time     // when Fresh last asked the reporter
	news  chan struct{} // closed, and made anew, when a report is made or heard
}

// head is the next job a consumer delivers: stored at time, read when the
// consumer had delivered up to after, at read.
type head struct {
	time, read time.Time
	after      uint64
}

// Open starts a watch of pool's queues of stage, until ctx ends.
func Open(ctx context.Context, js jetstream.JetStream, stage dispatcher.Stage, pool string, opts Options) (*Watch, error) {
	if opts.ID == "" {
		opts.ID = dispatcher.Token()
	}
	if opts.Log == nil {
		opts.Log = logging.Discard()
	}
	w := &Watch{js: js, nc: js.Conn(), stage: stage, pool: pool, opts: opts, heads: map[string]*head{}, since: map[string]time.Time{},
		pace: BusyEvery, poke: make(chan struct{}, 1), news: make(chan struct{})}
	subs := []*nats.Subscription{}
	unsubscribe := func() {
		for _, s := range subs {
			s.Unsubscribe()
		}
	}
	sub, err := w.nc.Subscribe(dispatcher.QueuesSubject(stage, pool), w.onReport)
	if err != nil {
		return nil, err
	}
	subs = append(subs, sub)
	if opts.Publish {
		// Asks are addressed to the reporter by its id: the pool's other
		// workers hear none.
		sub, err := w.nc.Subscribe(dispatcher.QueuesAskSubject(stage, pool, opts.ID), func(*nats.Msg) {
			select {
			case w.poke <- struct{}{}:
			default:
			}
		})
		if err != nil {
			unsubscribe()
			return nil, err
		}
		subs = append(subs, sub)
	}
	go func() {
		defer unsubscribe()
		if opts.Publish {
			w.report(ctx)
			return
		}
		<-ctx.Done()
	}()
	return w, nil
}

// ID is the watch's id, Report.By of its own reports.
func (w *Watch) ID() string { return w.opts.ID }

// News is closed at the next report this watch makes or hears.
func (w *Watch) News() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.news
}

// Latest returns the pool's report: the reporter's last, when this watch
// hears a fresh one; otherwise its own, listed anew when older than
// maxAge (and published, when this watch reports). The reporter's own
// last serves until its next listing is due, whatever maxAge: its
// reporting loop lists at the pace the pool's state asks for.
func (w *Watch) Latest(ctx context.Context, maxAge time.Duration) (*Report, error) {
	if r := w.last(maxAge); r != nil {
		return r, nil
	}
	return w.listNow(ctx, maxAge)
}

// Fresh is Latest for a reader that needs news younger than maxAge (a
// decode gate closed by the prefills it let through since its last
// report): when the reporter's last is older, it asks the reporter to
// list now (at most once a maxAge), and waits up to maxAge for the
// answer. The reporter lists at its own pace otherwise, which is up to
// IdleEvery after the pool was idle.
func (w *Watch) Fresh(ctx context.Context, maxAge time.Duration) (*Report, error) {
	r, err := w.Latest(ctx, maxAge)
	if err != nil || r.By == w.opts.ID || r.Age() < maxAge {
		return r, err
	}
	w.mu.Lock()
	ask, news := time.Since(w.asked) >= maxAge, w.news
	if ask {
		w.asked = time.Now()
	}
	w.mu.Unlock()
	if ask {
		_ = w.nc.Publish(dispatcher.QueuesAskSubject(w.stage, w.pool, r.By), nil) // lost: the reporter's pace
	}
	t := time.NewTimer(maxAge)
	defer t.Stop()
	select {
	case <-news:
	case <-t.C:
	case <-ctx.Done():
	}
	return w.Latest(ctx, maxAge)
}

// last is the report Latest may return without listing, or nil.
func (w *Watch) last(maxAge time.Duration) *Report {
	w.mu.Lock()
	defer w.mu.Unlock()
	if h := w.heard; h != nil && h.fresh() {
		return h
	}
	// The reporter's own last serves until its next is due; not one made
	// before another's was heard (a reporter back after a while).
	if o := w.own; o != nil && (o.Age() < maxAge || w.reporting() && o.fresh() && (w.heard == nil || o.at.After(w.heard.at))) {
		return o
	}
	return nil
}

// reporting says whether this watch is the pool's reporter now: it
// publishes, and hears no fresh report of one sorting before it. w.mu is
// held.
func (w *Watch) reporting() bool {
	return w.opts.Publish && (w.heard == nil || !w.heard.fresh())
}

// listNow lists the consumers, unless a listing younger than maxAge was
// made while it waited for the one running, and publishes what it found
// when this watch reports.
func (w *Watch) listNow(ctx context.Context, maxAge time.Duration) (*Report, error) {
	w.listMu.Lock()
	defer w.listMu.Unlock()
	w.mu.Lock()
	o := w.own
	w.mu.Unlock()
	if o != nil && o.Age() < maxAge {
		return o, nil
	}
	r, err := w.list(ctx)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	w.own = r
	send := w.reporting()
	w.announce()
	w.mu.Unlock()
	if send {
		if data, err := json.Marshal(r); err == nil {
			// Lost, the others list themselves once it is stale.
			_ = w.nc.Publish(dispatcher.QueuesSubject(w.stage, w.pool), data)
		}
	}
	return r, nil
}

// report lists and publishes at the pace of what it finds, while this
// watch is the reporter, until ctx ends; while another reports, it wakes
// when that one's report would go stale. The reporter also adopts
// orphaned jobs (Options.Adopt).
func (w *Watch) report(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	var adopting sync.WaitGroup
	defer adopting.Wait()
	was := false // reporting on the last round
	for {
		asked := false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-w.poke:
			asked = true
		}
		w.mu.Lock()
		reporting, heard := w.reporting(), w.heard
		w.mu.Unlock()
		if was = was && reporting; !reporting {
			t.Reset(time.Until(heard.at.Add(staleAfter(time.Duration(heard.NextMs) * time.Millisecond))))
			continue
		}
		w.listMu.Lock()
		pace := w.pace
		switch {
		case !was:
			pace = 0 // reporting again: what it listed before another reported is old
		case asked:
			pace = askedFresh
		}
		w.listMu.Unlock()
		was = true
		// Adoption runs beside the listings, one at a time, a second
		// after the last ended: it may take a while (a consumer made while
		// JetStream elects a leader), and the reports must come on time.
		if w.opts.Adopt != nil && time.Since(time.Unix(0, w.adopted.Load())) >= adoptEvery && w.adopting.CompareAndSwap(false, true) {
			adopting.Go(func() {
				defer w.adopting.Store(false)
				actx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				w.opts.Adopt(actx)
				w.adopted.Store(time.Now().UnixNano())
			})
		}
		if _, err := w.listNow(ctx, pace); err != nil && ctx.Err() == nil {
			w.opts.Log.Debug("could not list the pool's consumers", "stage", w.stage, "pool", w.pool, logging.Err(err))
		}
		w.listMu.Lock()
		pace = w.pace
		w.listMu.Unlock()
		t.Reset(pace)
	}
}

// onReport keeps a report heard from another watch of the pool, when it
// sorts first among the fresh ones; a publishing watch keeps only those
// that sort before itself (the others will hear its own, and stop).
func (w *Watch) onReport(m *nats.Msg) {
	r := &Report{}
	if err := json.Unmarshal(m.Data, r); err != nil || r.By == "" || r.By == w.opts.ID {
		return
	}
	r.at = time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.opts.Publish && r.By > w.opts.ID {
		return
	}
	if h := w.heard; h != nil && h.fresh() && h.By < r.By {
		return
	}
	w.heard = r
	w.announce()
}

// list reads the state of the pool's consumers, in one list request.
// w.listMu is held.
func (w *Watch) list(ctx context.Context) (*Report, error) {
	if w.stream == nil {
		st, err := w.js.Stream(ctx, dispatcher.StageStream(w.stage))
		if err != nil {
			return nil, err
		}
		w.stream = st
	}
	began := time.Now()
	infos, err := dispatcher.PoolConsumersOf(ctx, w.stream, w.stage, w.pool)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			w.stream = nil
		}
		return nil, err
	}
	if began.Sub(w.listed) > staleAfter(w.pace) {
		// What the listings before saw is too old to say what stayed so.
		clear(w.since)
		clear(w.heads)
	}
	shared := dispatcher.ConsumerName(w.stage, w.pool)
	r := &Report{By: w.opts.ID, Adopts: w.opts.Adopt != nil}
	r.Shared.Missing = true
	seen := map[string]bool{}
	for _, info := range infos {
		seen[info.Name] = true
		r.Pending += int(info.NumPending)
		r.Held += info.NumAckPending
		// An engine's consumer with jobs waiting and no pull may be behind:
		// its next job is timed exactly, not on one delivered since.
		candidate := info.Name != shared && info.NumPending > 0 && info.NumWaiting == 0
		age := w.waited(ctx, info, candidate)
		r.HeadMs = max(r.HeadMs, age.Milliseconds())
		if info.Name == shared {
			r.Waiting, r.Shared.Pending, r.Shared.HeadMs, r.Shared.Missing = info.NumWaiting, int(info.NumPending), age.Milliseconds(), false
			continue
		}
		// Behind: it delivers, but takes less than comes for it.
		behind := candidate && age >= StuckAfter
		if !stuckConsumer(info) && !behind {
			delete(w.since, info.Name)
			continue
		}
		first, ok := w.since[info.Name]
		if !ok {
			first = began
			w.since[info.Name] = first
		}
		if began.Sub(first) >= StuckAfter {
			r.Stuck = append(r.Stuck, Stuck{Consumer: info.Name, Jobs: int(info.NumPending) + info.NumAckPending})
		}
	}
	for name := range w.heads {
		if !seen[name] {
			delete(w.heads, name)
		}
	}
	for name := range w.since {
		if !seen[name] {
			delete(w.since, name)
		}
	}
	now := time.Now()
	w.listed = now
	if r.Busy() {
		w.pace = BusyEvery
	} else {
		w.pace = min(2*w.pace, IdleEvery)
	}
	// The next report comes a pace after this one, and takes as long to
	// list.
	r.NextMs, r.at = (w.pace + now.Sub(began)).Milliseconds(), now
	return r, nil
}

// waited is how long the next job a consumer delivers has waited: the
// first of its filter after the last it delivered (a job waiting to be
// delivered again is not counted, as NumPending does not count it). It is
// read again only when the consumer has delivered more: at once when
// exact, otherwise at most every headEvery (the next job is then at most
// as old as the one timed). 0 when none waits, or it cannot be read.
// w.listMu is held.
func (w *Watch) waited(ctx context.Context, info *jetstream.ConsumerInfo, exact bool) time.Duration {
	if info.NumPending == 0 {
		delete(w.heads, info.Name)
		return 0
	}
	h := w.heads[info.Name]
	if h == nil {
		h = &head{}
		w.heads[info.Name] = h
	}
	if h.time.IsZero() || info.Delivered.Stream != h.after && (exact || time.Since(h.read) >= headEvery) {
		h.after, h.read, h.time = info.Delivered.Stream, time.Now(), w.nextStored(ctx, info)
	}
	if h.time.IsZero() {
		return 0
	}
	return info.TimeStamp.Sub(h.time)
}

// nextStored is when the next job the consumer of info delivers (the
// first of its filter after the last it delivered) was stored; zero if it
// cannot be read.
func (w *Watch) nextStored(ctx context.Context, info *jetstream.ConsumerInfo) time.Time {
	m, err := w.stream.GetMsg(ctx, info.Delivered.Stream+1, jetstream.WithGetMsgSubject(info.Config.FilterSubject))
	if err != nil {
		return time.Time{}
	}
	return m.Time
}

// stuckConsumer says whether an engine's consumer has jobs that its engine
// does not take: pending, or delivered and not acked (NumPending does not
// count a job nak'd, or whose ack wait ran out, to be delivered again),
// with no pull waiting and nothing delivered for StuckAfter (by the
// server's clock).
func stuckConsumer(info *jetstream.ConsumerInfo) bool {
	if info.NumPending == 0 && info.NumAckPending == 0 || info.NumWaiting > 0 {
		return false
	}
	last := info.Created
	if info.Delivered.Last != nil {
		last = *info.Delivered.Last
	}
	return info.TimeStamp.Sub(last) >= StuckAfter
}
