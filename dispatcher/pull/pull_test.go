package pull

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/nats/embedded/embeddedtest"
	"github.com/pdq-dev/pdq/pkg/logging"
)

func TestPullEnded(t *testing.T) {
	for _, tc := range []struct {
		status, description string
		want                error // nil: an error of its own, naming the status
	}{
		{"404", "No Messages", nats.ErrTimeout},
		{"408", "Request Timeout", nats.ErrTimeout},
		{"409", "Leadership Change", nats.ErrTimeout},
		{"409", "Server Shutdown", nats.ErrTimeout},
		{"409", "Consumer Deleted", jetstream.ErrConsumerDeleted},
		{"503", "", nats.ErrNoResponders},
		{"409", "Exceeded MaxWaiting", nil},
	} {
		err := pullEnded(tc.status, tc.description)
		switch {
		case tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("%s %s: %v, want %v", tc.status, tc.description, err, tc.want)
		case tc.want == nil && (errors.Is(err, nats.ErrTimeout) || !strings.Contains(err.Error(), tc.description)):
			t.Errorf("%s %s: %v, want an error that names it", tc.status, tc.description, err)
		}
	}
}

// TestDoubleAckGivesUp: a confirmed ack whose context has no deadline
// gives up after the puller's timeout, as the jetstream client's does,
// when no answer comes (one lost to a reconnect, say), instead of holding
// its job's settling, and so the loop's stop, for good.
func TestDoubleAckGivesUp(t *testing.T) {
	nc := embeddedtest.Conn(t, logging.Discard())
	silent, err := nc.SubscribeSync("ack.silent") // takes the ack, never answers
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Unsubscribe()
	inbox, err := nc.SubscribeSync(nc.NewInbox())
	if err != nil {
		t.Fatal(err)
	}
	defer inbox.Unsubscribe()
	job := pulled{m: &nats.Msg{Subject: "pdq.prefill.p.x", Reply: "ack.silent", Sub: inbox}, timeout: 200 * time.Millisecond}
	done := make(chan error, 1)
	go func() { done <- job.DoubleAck(context.Background()) }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("an ack nobody answered was confirmed")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("DoubleAck still waits for an answer that will not come")
	}
}

// TestPullerKeepsItsInbox: pulls that surely ended, with a job or their
// expiry, leave their subscription to the next pull, and a stale word on
// an earlier pull is not taken for the current one's; a pull whose end is
// unsure (a 409 of a server shutting down, or silence) takes its
// subscription along, unsubscribed, so that a late answer to it is never
// taken for the next one's.
func TestPullerKeepsItsInbox(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	pool := dispatcher.PoolName(t.Name())
	cons, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	base := nc.NumSubscriptions()
	p := NewPuller(ctx, nc, js, 20*time.Millisecond)
	var inbox string
	for i := range 3 {
		if _, err := p.Next(ctx, cons); !errors.Is(err, nats.ErrTimeout) {
			t.Fatalf("pull %d: %v, want a time-out", i, err)
		}
		if i == 0 {
			inbox = p.inbox
		} else if p.inbox != inbox {
			t.Fatalf("pull %d answered on %q after %q", i, p.inbox, inbox)
		}
	}
	if _, err := js.Publish(ctx, dispatcher.JobSubject(dispatcher.StagePrefill, pool, "keep-1"), []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	job, err := p.Next(ctx, cons)
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Ack(); err != nil {
		t.Fatal(err)
	}
	if p.inbox != inbox || nc.NumSubscriptions() != base+1 {
		t.Errorf("after a job: inbox %q (was %q), %d subscriptions (want %d)", p.inbox, inbox, nc.NumSubscriptions(), base+1)
	}
	if late := p.Stop(); len(late) != 0 || nc.NumSubscriptions() != base {
		t.Errorf("stop: %d late jobs, %d subscriptions left; want none, %d", len(late), nc.NumSubscriptions(), base)
	}

	// A stand-in for the server, which answers each pull as told: the
	// words that surely end a request keep the subscription, a stale word
	// on an earlier request is not taken for the current one's, and any
	// other end, or silence, takes the subscription along.
	type answer struct{ stale, status, description string }
	script := []answer{
		{status: "408", description: "Request Timeout"},
		{stale: "409 Consumer Deleted", status: "408", description: "Request Timeout"},
		{status: "409", description: "Server Shutdown"},
		{}, // silent
		{},
	}
	var turn atomic.Int32
	var last atomic.Value // the previous request's reply subject
	requests := make(chan string, len(script))
	word := func(subject, status, description string) *nats.Msg {
		m := nats.NewMsg(subject)
		m.Header.Set("Status", status)
		m.Header.Set("Description", description)
		return m
	}
	server, err := nc.Subscribe("pdqtest.api.>", func(m *nats.Msg) {
		a := script[turn.Add(1)-1]
		if a.stale != "" {
			prev, _ := last.Load().(string)
			status, description, _ := strings.Cut(a.stale, " ")
			nc.PublishMsg(word(prev, status, description))
		}
		last.Store(m.Reply)
		if a.status != "" {
			nc.PublishMsg(word(m.Reply, a.status, a.description))
		}
		requests <- m.Reply
	})
	if err != nil {
		t.Fatal(err)
	}
	defer server.Unsubscribe()
	base = nc.NumSubscriptions()
	p = NewPuller(ctx, nc, js, 20*time.Millisecond)
	defer p.Stop()
	p.api = "pdqtest.api."
	subscription := func(reply string) string { return reply[:strings.LastIndexByte(reply, '.')] }
	var subs []string
	for i, want := range []struct {
		kept bool
		err  error
	}{{true, nats.ErrTimeout}, {true, nats.ErrTimeout}, {false, nats.ErrTimeout}, {false, nats.ErrTimeout}, {false, nats.ErrTimeout}} {
		if _, err := p.Next(ctx, cons); !errors.Is(err, want.err) {
			t.Fatalf("pull %d: %v, want %v", i, err, want.err)
		}
		subs = append(subs, subscription(<-requests))
		if kept := p.sub != nil; kept != want.kept || nc.NumSubscriptions() != base+map[bool]int{true: 1}[kept] {
			t.Errorf("pull %d: subscription kept %v (%d subscriptions), want %v", i, kept, nc.NumSubscriptions(), want.kept)
		}
	}
	if subs[0] != subs[1] || subs[1] != subs[2] {
		t.Errorf("pulls ended by their expiry did not keep their subscription: %q", subs[:3])
	}
	if subs[2] == subs[3] || subs[3] == subs[4] {
		t.Errorf("a pull whose end is unsure shares its subscription with the next: %q", subs[2:])
	}
}
