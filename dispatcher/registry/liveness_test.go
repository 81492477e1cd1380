package registry

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// TestLiveness checks what counts as a gone gateway: only an unbroken
// silence of goneAfter, heard while this process's own connection was up;
// not the silence of a gateway whose connection blipped, nor one heard
// around this process's own reconnect.
func TestLiveness(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	ctx := context.Background()
	pings, err := AnswerPings(nc, "gw-up")
	if err != nil {
		t.Fatal(err)
	}
	defer pings.Unsubscribe()
	l := NewLiveness(nc)
	l.stable = time.Now().Add(-time.Minute) // connected for a while
	if !l.Alive(ctx, "gw-up") || !l.Alive(ctx, "") {
		t.Error("a gateway that answers, or a replay, counted as gone")
	}
	if !l.Alive(ctx, "gw-never") {
		t.Error("one unanswered ping counted as gone: the gateway's connection may have blipped")
	}
	l.silent["gw-never"] = silence{first: time.Now().Add(-goneAfter), last: time.Now().Add(-time.Second)}
	if l.Alive(ctx, "gw-never") {
		t.Error("a gateway silent for goneAfter at every ping still counts as alive")
	}
	l.silent["gw-old"] = silence{first: time.Now().Add(-time.Hour), last: time.Now().Add(-10 * time.Minute)}
	if !l.Alive(ctx, "gw-old") {
		t.Error("an old silence, with no ping for minutes, was taken for an unbroken one")
	}
	l.silent["gw-never"] = silence{first: time.Now().Add(-goneAfter), last: time.Now().Add(-time.Second)}
	l.reconnects-- // as if this connection had just come back
	if !l.Alive(ctx, "gw-never") {
		t.Error("right after this process's own reconnect, silence was taken for a gone gateway")
	}
}

// TestLivenessRenewsBehind checks that a gateway's answer past aliveFor is
// renewed by a ping the caller does not wait for: the answer below comes
// only after Alive has returned, and still counts.
func TestLivenessRenewsBehind(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	ctx := context.Background()
	got, release := make(chan struct{}, 1), make(chan struct{})
	slow, err := nc.Subscribe(dispatcher.GatewaySubject("gw-slow"), func(m *nats.Msg) {
		got <- struct{}{}
		<-release
		_ = m.Respond(nil)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Unsubscribe()
	l := NewLiveness(nc)
	old := time.Now().Add(-aliveFor - time.Millisecond)
	l.seen["gw-slow"] = old
	if !l.Alive(ctx, "gw-slow") {
		t.Fatal("a gateway that answered within goneAfter counted as gone")
	}
	select {
	case <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("no ping went out for an answer past aliveFor")
	}
	close(release)
	dispatchertest.WaitFor(t, "the late answer taken", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.seen["gw-slow"].After(old)
	})
}
