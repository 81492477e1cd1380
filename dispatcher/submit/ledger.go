package submit

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// Ledger keeps the record writes the gateway could not make while NATS was
// out of reach (a request's end: done, failed, cancelled, expired) and makes
// them once it is back. A record left queued would keep its id unusable
// until its deadline, hide the failure from pdq requests --failed, and let
// a job stored just before the outage run for a client who has its answer.
//
// A write applies only to the request the gateway ran: the record of its
// claim (the same Created). A retry that has claimed the id since is left
// alone.
//
// Request handlers call Write, Keep, FlushFor, Has and Len, any number at
// once. Run has a goroutine of its own (the gateway's Run starts it), and
// each flush makes its writes from flushWorkers goroutines. A write's
// change may so run on a flush worker after Write has returned: whatever
// it sets for its caller must be safe to read from another goroutine (see
// the gateway's handlers.stop).
type Ledger struct {
	// Set by NewLedger, read without a lock.
	nc      *nats.Conn
	records *dispatcher.Records
	log     *slog.Logger
	lastTry time.Duration // bounds the writes made at shutdown

	// mu guards the fields below. No NATS call is made under it: apply
	// runs with mu free.
	mu      sync.Mutex
	pending map[string]pendingWrite
	seq     uint64
	stopped bool // Run has ended: a write is made at once, or lost
}

// pendingWrite is a record write waiting for NATS.
type pendingWrite struct {
	created time.Time // the claim's: the request the write is for
	change  func(*dispatcher.Record) error
	seq     uint64 // which write for the request: the latest stands
}

// maxPending bounds the writes the ledger holds; past it a write is dropped
// (its record ends at its deadline instead), with a warning.
const maxPending = 100_000

// NewLedger makes a gateway's ledger; the gateway runs its Run. lastTry
// bounds the last flush as Run ends, and each write made after it.
func NewLedger(nc *nats.Conn, records *dispatcher.Records, lastTry time.Duration, log *slog.Logger) *Ledger {
	return &Ledger{nc: nc, records: records, log: log, lastTry: lastTry, pending: make(map[string]pendingWrite)}
}

// Write applies change to the record of id that a claim wrote at created,
// now if NATS answers, or else once it is back. A change that returns
// dispatcher.ErrNoChange leaves the record alone, as in a Transition.
// It reports whether the write was made now.
func (l *Ledger) Write(ctx context.Context, id string, created time.Time, change func(*dispatcher.Record) error, log *slog.Logger) bool {
	w := pendingWrite{created: created, change: change}
	if l.nc.IsConnected() {
		err := l.apply(ctx, id, w)
		if err == nil {
			return true
		}
		log.Debug("could not write the request's record; keeping the write until NATS answers", logging.Err(err))
	}
	l.Keep(id, created, change) // the latest write for a request stands
	return false
}

// Keep holds a write for later, without trying it now: its caller has just
// tried it.
func (l *Ledger) Keep(id string, created time.Time, change func(*dispatcher.Record) error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stopped {
		// A request that ended after the last flush, at shutdown: one try.
		l.mu.Unlock()
		defer l.mu.Lock()
		ctx, cancel := context.WithTimeout(context.Background(), l.lastTry)
		defer cancel()
		if err := l.apply(ctx, id, pendingWrite{created: created, change: change}); err != nil {
			l.log.Warn("could not write a request's end at shutdown: its record ends at its deadline", logging.KeyRequestID, id, logging.Err(err))
		}
		return
	}
	if _, ok := l.pending[id]; !ok && len(l.pending) >= maxPending {
		l.log.Warn("too many record writes wait for NATS: one is dropped, and its record ends at its deadline", logging.KeyRequestID, id)
		return
	}
	l.seq++
	l.pending[id] = pendingWrite{created: created, change: change, seq: l.seq}
}

// apply makes one write. A record gone from the bucket, or one another
// request has claimed since, needs none.
func (l *Ledger) apply(ctx context.Context, id string, w pendingWrite) error {
	_, err := l.records.Transition(ctx, id, func(r *dispatcher.Record) error {
		if !r.Created.Equal(w.created) {
			return dispatcher.ErrNoChange
		}
		return w.change(r)
	})
	if errors.Is(err, dispatcher.ErrNoRecord) {
		return nil
	}
	return err
}

// Has reports whether a write for id waits.
func (l *Ledger) Has(id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.pending[id]
	return ok
}

// Len is the number of writes waiting.
func (l *Ledger) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.pending)
}

// Run makes the waiting writes while NATS is connected, looking four times
// a second: a request the outage ended must be recorded so before the
// workers, reconnecting too, pull its jobs. It makes a last try as ctx
// ends.
func (l *Ledger) Run(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.Background(), l.lastTry)
			l.flush(fctx)
			cancel()
			l.mu.Lock()
			l.stopped = true
			l.mu.Unlock()
			if n := l.Len(); n > 0 {
				l.log.Warn("record writes still waited for NATS at shutdown: those records end at their deadline", "writes", n)
			}
			return
		case <-t.C:
		}
		l.flush(ctx)
	}
}

// flush tries every waiting write once, while NATS is connected.
func (l *Ledger) flush(ctx context.Context) {
	l.mu.Lock()
	ids := make([]string, 0, len(l.pending))
	for id := range l.pending {
		ids = append(ids, id)
	}
	l.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	// A few at once: after a long outage thousands may wait, and workers
	// pull the jobs of requests whose end is not written yet.
	var written atomic.Int64
	var wg sync.WaitGroup
	work := make(chan string)
	for range min(flushWorkers, len(ids)) {
		wg.Go(func() {
			for id := range work {
				if l.flushOne(ctx, id) {
					written.Add(1)
				}
			}
		})
	}
	for _, id := range ids {
		if !l.nc.IsConnected() || ctx.Err() != nil {
			break
		}
		work <- id
	}
	close(work)
	wg.Wait()
	if n := written.Load(); n > 0 {
		l.log.Info("wrote the records that waited for NATS", "writes", n, "still_waiting", l.Len())
	}
}

// flushWorkers is how many waiting writes a flush makes at once.
const flushWorkers = 8

// FlushFor makes the writes waiting for id, and for the prompts of a batch
// under id (<id>-<i>), before a request under id is taken: a retry finds
// its earlier request ended.
func (l *Ledger) FlushFor(ctx context.Context, id string) {
	l.mu.Lock()
	var ids []string
	for k := range l.pending {
		if k == id || (strings.HasPrefix(k, id+"-") && isDigits(k[len(id)+1:])) {
			ids = append(ids, k)
		}
	}
	l.mu.Unlock()
	for _, k := range ids {
		l.flushOne(ctx, k)
	}
}

func isDigits(s string) bool {
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return s != ""
}

// flushOne makes the write waiting for id, and reports whether it did.
func (l *Ledger) flushOne(ctx context.Context, id string) bool {
	l.mu.Lock()
	w, ok := l.pending[id]
	l.mu.Unlock()
	if !ok {
		return false
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err := l.apply(wctx, id, w)
	cancel()
	if err != nil {
		l.log.Debug("a record write still waits for NATS", logging.KeyRequestID, id, logging.Err(err))
		return false
	}
	l.mu.Lock()
	if cur, ok := l.pending[id]; ok && cur.seq == w.seq {
		delete(l.pending, id)
	}
	l.mu.Unlock()
	return true
}
