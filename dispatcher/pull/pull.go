package pull

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/internal/jsapi"
	"github.com/pdq-dev/pdq/internal/sleep"
)

// MinPullWait keeps an idle loop from pulling without a pause.
const MinPullWait = 10 * time.Millisecond

// pullSilence is how long past its expiry a request waits for the
// server's word that it ended. A request lives on the server it was sent
// to: when that server dies, nobody answers it, and the slot pulls again
// after this. (A consumer leader that moves tells its requests so.)
const pullSilence = time.Second

// reconnectPoll is how often a slot looks whether a dropped connection is
// back.
const reconnectPoll = 50 * time.Millisecond

// Puller pulls jobs, one per request, for a loop's slots. A slot whose
// loop stops waits for its request to end rather than unsubscribing from
// it: the server sends a job to a waiting request from its own queue, a
// moment after it checked that someone listens, so a job can reach an
// unsubscribed request, to be dropped (the jetstream client's Next drops
// it so). A dropped job waits out its ack wait, and a handoff that comes
// back that way counts as delivered: that costs a new prefill, and leaves
// the first one's KV held for its lease. A job that comes as the loop
// stops is kept for stop, which returns it to be given back.
//
// One goroutine calls next and then stop: the stage loop's Run, or its
// release loop, each with a Puller of its own. NewPuller starts the other
// goroutine, which renews ctx when the connection drops, until stop.
type Puller struct {
	// Set by NewPuller, read without a lock.
	nc      *nats.Conn
	api     string        // JetStream's API prefix, with its final dot
	wait    time.Duration // a request's expiry
	timeout time.Duration // a confirmed ack's, when its context has no deadline
	req     []byte        // every pull's request: one job, expiring after wait
	done    chan struct{} // closed by stop

	// The subscription pulls are answered on, inbox.*, kept from one pull
	// to the next (a subscribe and an unsubscribe a job showed in profiles:
	// docs/benchmarks.md). Only the loop's goroutine pulls, one request at a
	// time, each answered at a subject of its own, inbox.<n>. It is kept
	// only past a request that surely ended: with its job (one asked for)
	// or with its expiry (408). The server's word comes at the request's
	// own subject, so a stale one (a new consumer leader tells of requests
	// that ended already) is told apart; a job comes at its stream's, and
	// could not be. Any other end (a 409 of a server shutting down, which
	// may still deliver), and a request given up (its connection dropped,
	// or its server silent), takes the subscription along, unsubscribed,
	// as each pull did with its own before.
	//
	// inbox, sub, msgs and n are the pulling goroutine's, without a lock.
	inbox string // the subscription's subject, but for its last token
	sub   *nats.Subscription
	msgs  chan *nats.Msg
	n     uint64 // the last request's token

	// mu guards the fields below.
	mu     sync.Mutex
	late   []*nats.Msg     // jobs that came as the loop stopped
	ctx    context.Context // the current pulls' scope: until nc drops
	cancel context.CancelFunc
}

// NewPuller returns a puller whose pulls end when nc drops. Call stop
// when the loop is done with it.
func NewPuller(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, wait time.Duration) *Puller {
	o := js.Options()
	p := &Puller{nc: nc, api: jsapi.Prefix(o), wait: wait, timeout: jsapi.Timeout(o), done: make(chan struct{}),
		req: fmt.Appendf(nil, `{"batch":1,"expires":%d}`, wait.Nanoseconds())}
	// A stopping loop's last pull still ends when the connection drops.
	root := context.WithoutCancel(ctx)
	p.ctx, p.cancel = context.WithCancel(root)
	status := nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING)
	go func() {
		defer nc.RemoveStatusListener(status)
		for {
			select {
			case <-p.done:
				return
			case <-status:
			}
			p.mu.Lock()
			p.cancel()
			p.ctx, p.cancel = context.WithCancel(root)
			p.mu.Unlock()
		}
	}()
	return p
}

// Next waits for one job of cons. Once ctx has ended it still waits for
// the request to end (its wait at most), and returns ctx's error; a
// job that came is kept for stop. A pull ended by a dropped connection,
// or by the server's silence, returns nats.ErrTimeout, as a pull that
// found no job: the caller just pulls again. The subscription is kept
// for the next pull only when the request surely ended (see puller).
func (p *Puller) Next(ctx context.Context, cons jetstream.Consumer) (jetstream.Msg, error) {
	// A pull sent while the connection is down would only wait in the
	// client's reconnect buffer, to reach the server stale.
	for !p.nc.IsConnected() {
		if err := sleep.For(ctx, reconnectPoll); err != nil {
			return nil, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	pctx, reconnects := p.scope(), p.nc.Stats().Reconnects
	if p.sub == nil {
		inbox := p.nc.NewInbox() + "."
		// A channel of its own: a sync subscription's is 64K slots,
		// 512 KB. This one gets a job or the server's word, one at a time.
		msgs := make(chan *nats.Msg, 4)
		sub, err := p.nc.ChanSubscribe(inbox+"*", msgs)
		if err != nil {
			return nil, fmt.Errorf("subscribe to a pull's inbox: %w", err)
		}
		p.inbox, p.sub, p.msgs = inbox, sub, msgs
	}
	keep := false // the request surely ended, with no word to come
	defer func() {
		if !keep {
			p.retire()
		}
	}()
	msgs := p.msgs
	p.n++
	reply := p.inbox + strconv.FormatUint(p.n, 10)
	info := cons.CachedInfo()
	if err := p.nc.PublishRequest(p.api+"CONSUMER.MSG.NEXT."+info.Stream+"."+info.Name, reply, p.req); err != nil {
		return nil, fmt.Errorf("send a pull request: %w", err)
	}
	silence := time.NewTimer(p.wait + pullSilence)
	defer silence.Stop()
	ended := false // the wait did: no more waiting after what is at hand
	for {
		var m *nats.Msg
		if !ended {
			select {
			case m = <-msgs:
			case <-silence.C:
				ended = true
			case <-pctx.Done():
				if p.nc.IsConnected() && p.nc.Stats().Reconnects == reconnects {
					// A drop heard late, from before this pull was sent on
					// the connection that is up: the pull still waits.
					pctx = p.scope()
					continue
				}
				ended = true
			}
		}
		if m == nil {
			select {
			case m = <-msgs: // it came as the wait ended: still taken
			default:
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				return nil, nats.ErrTimeout
			}
		}
		if m.Reply != "" { // a job, to be acked there: the server's own word has no reply subject
			keep = true
			if ctx.Err() != nil {
				p.mu.Lock()
				p.late = append(p.late, m)
				p.mu.Unlock()
				return nil, ctx.Err()
			}
			return pulled{m, p.timeout}, nil
		}
		if m.Subject != reply {
			m = nil // the word on an earlier request, which ended
			continue
		}
		if status := m.Header.Get("Status"); status != "100" {
			keep = status == "408"
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, pullEnded(status, m.Header.Get("Description"))
		}
	}
}

// retire unsubscribes the pulls' subscription, for the next pull to make
// a new one.
func (p *Puller) retire() {
	if p.sub != nil {
		p.sub.Unsubscribe()
		p.inbox, p.sub, p.msgs = "", nil, nil
	}
}

// scope is the current pulls' context, which ends when the connection drops.
func (p *Puller) scope() context.Context {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ctx
}

// pullEnded is the error of a request the server ended without a job.
// Those a slot just pulls again after are nats.ErrTimeout.
func pullEnded(status, description string) error {
	d := strings.ToLower(description)
	switch {
	case status == "404", status == "408",
		status == "409" && (strings.Contains(d, "leadership change") || strings.Contains(d, "server shutdown")):
		return nats.ErrTimeout
	case status == "409" && strings.Contains(d, "consumer deleted"):
		return jetstream.ErrConsumerDeleted
	case status == "503":
		return nats.ErrNoResponders
	}
	return fmt.Errorf("pull ended by the server: %s %s", status, description)
}

// Stop returns the jobs that came as the loop stopped, for the caller to
// give back, and unsubscribes the pulls' subscription: every request on
// it has ended by then. Call it once no slot pulls.
func (p *Puller) Stop() []jetstream.Msg {
	p.retire()
	close(p.done)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cancel()
	late := make([]jetstream.Msg, len(p.late))
	for i, m := range p.late {
		late[i] = pulled{m, p.timeout}
	}
	p.late = nil
	return late
}

// pulled is a job pulled by a puller, acked on its reply subject as the
// jetstream client acks. A confirmed ack whose context has no deadline
// waits timeout at most (see bounded).
type pulled struct {
	m       *nats.Msg
	timeout time.Duration
}

var _ jetstream.Msg = pulled{}

func (j pulled) Data() []byte         { return j.m.Data }
func (j pulled) Headers() nats.Header { return j.m.Header }
func (j pulled) Subject() string      { return j.m.Subject }
func (j pulled) Reply() string        { return j.m.Reply }
func (j pulled) Ack() error           { return j.m.Ack() }
func (j pulled) Nak() error           { return j.m.Nak() }
func (j pulled) InProgress() error    { return j.m.InProgress() }
func (j pulled) Term() error          { return j.m.Term() }

func (j pulled) DoubleAck(ctx context.Context) error {
	ctx, cancel := jsapi.Bounded(ctx, j.timeout)
	defer cancel()
	return j.m.AckSync(nats.Context(ctx))
}

func (j pulled) NakWithDelay(delay time.Duration) error { return j.m.NakWithDelay(delay) }

// TermWithReason terms the job with a reason the server puts in its
// advisory; the nats client has no call for it, so unlike the others it
// does not mark the job acked: pdq terms a job as the last thing it does
// with it.
func (j pulled) TermWithReason(reason string) error {
	if reason == "" {
		return j.m.Term()
	}
	return j.m.Respond([]byte("+TERM " + reason))
}

func (j pulled) Metadata() (*jetstream.MsgMetadata, error) {
	md, err := j.m.Metadata()
	if err != nil {
		return nil, err
	}
	return &jetstream.MsgMetadata{
		Sequence:     jetstream.SequencePair{Consumer: md.Sequence.Consumer, Stream: md.Sequence.Stream},
		NumDelivered: md.NumDelivered, NumPending: md.NumPending, Timestamp: md.Timestamp,
		Stream: md.Stream, Consumer: md.Consumer, Domain: md.Domain,
	}, nil
}
