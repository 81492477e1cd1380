package reply

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestReplies runs the reply protocol every way a chunk can travel: with
// headers, framed (Job.ReplyFramed), and framed to a gateway in the same
// process (LocalReplies), where the whole reply goes in memory.
func TestReplies(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	replies, err := NewReplies(nc, "gw1")
	if err != nil {
		t.Fatal(err)
	}
	defer replies.Close()
	local := NewLocalReplies()
	defer local.Add(replies)()
	for _, tc := range []struct {
		name          string
		framed, local bool
	}{{"headers", false, false}, {"framed", true, false}, {"local", true, true}} {
		newWriter := func(nc *nats.Conn, subject string, attempt int) *Writer {
			w := NewWriter(nc, subject, attempt)
			if tc.framed {
				w.Frame()
			}
			if tc.local {
				w.Local(local)
			}
			return w
		}
		t.Run(tc.name, func(t *testing.T) { testReplies(t, nc, replies, tc.name+"-", newWriter, !tc.local) })
	}
}

// TestLocalReplies checks that a writer in the gateway's process queues its
// reply without publishing any of it, and publishes it again once the
// gateway has left the set, or when it is not framed.
func TestLocalReplies(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	replies, err := NewReplies(nc, "gw-local")
	if err != nil {
		t.Fatal(err)
	}
	defer replies.Close()
	local := NewLocalReplies()
	remove := local.Add(replies)
	ctx := context.Background()
	// run sends a reply and returns how many of its messages went through
	// the server.
	run := func(t *testing.T, id string, framed bool) int {
		t.Helper()
		s, err := replies.Open(id)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		sub, err := nc.SubscribeSync(replies.Subject(id))
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Unsubscribe()
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		w := NewWriter(nc, replies.Subject(id), 1)
		if framed {
			w.Frame()
		}
		w.Local(local)
		w.Chunk([]byte("a"))
		w.Chunks([][]byte{[]byte("b"), []byte("c")})
		done := make(chan error, 1)
		go func() { done <- w.Done() }()
		for _, c := range []string{"a", "b", "c"} {
			if r, err := s.Next(ctx, 5*time.Second); err != nil || r.Kind != dispatcher.KindChunk || string(r.Data) != c {
				t.Fatalf("got %+v, %v; want chunk %q", r, err, c)
			}
		}
		if r, err := s.Next(ctx, 5*time.Second); err != nil || r.Kind != dispatcher.KindDone {
			t.Fatalf("got %+v, %v; want done", r, err)
		}
		if err := <-done; err != nil {
			t.Fatalf("done: %v", err)
		}
		// The server sends this connection what it published before it
		// answers the flush: every message sent is pending by then.
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		n, _, err := sub.Pending()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := run(t, "in-process", true); n != 0 {
		t.Errorf("%d reply messages went through NATS to a gateway in the same process; want 0", n)
	}
	// Two chunk messages and the end.
	if n := run(t, "unframed", false); n != 3 {
		t.Errorf("an unframed writer published %d reply messages; want 3", n)
	}
	remove()
	if n := run(t, "removed", true); n != 3 {
		t.Errorf("after the gateway left the set, %d reply messages were published; want 3", n)
	}
}

// TestLocalRepliesMigrate moves a reply between a writer in the gateway's
// process and one in another (over NATS), both ways, with beats running
// and a reader that falls behind: the gateway gets every chunk once, in
// order, then the end.
func TestLocalRepliesMigrate(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	replies, err := NewReplies(nc, "gw-migrate")
	if err != nil {
		t.Fatal(err)
	}
	defer replies.Close()
	local := NewLocalReplies()
	defer local.Add(replies)()
	ctx := context.Background()
	const n = 100 // chunks per writer
	for _, firstLocal := range []bool{true, false} {
		name := map[bool]string{true: "from local to NATS", false: "from NATS to local"}[firstLocal]
		t.Run(name, func(t *testing.T) {
			id := fmt.Sprintf("migrate-%v", firstLocal)
			s, err := replies.Open(id)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			writer := func(generation int, inProcess bool) *Writer {
				w := NewWriter(nc, replies.Subject(id), dispatcher.ReplyAttempt(generation, 1))
				w.Frame()
				if inProcess {
					w.Local(local)
				}
				return w
			}
			ended := make(chan error, 1)
			go func() {
				first := writer(1, firstLocal)
				stop := first.Beats(ctx, 2*time.Millisecond)
				for i := range n {
					first.Chunk([]byte(strconv.Itoa(i)))
				}
				err := first.Moved()
				stop()
				if err != nil {
					ended <- fmt.Errorf("moved: %w", err)
					return
				}
				second := writer(2, !firstLocal)
				second.ContinueAt(n)
				stop = second.Beats(ctx, 2*time.Millisecond)
				defer stop()
				for i := n; i < 2*n; i++ {
					second.Chunk([]byte(strconv.Itoa(i)))
				}
				ended <- second.Done()
			}()
			for i := range 2 * n {
				r, err := s.Next(ctx, 5*time.Second)
				if err != nil || r.Kind != dispatcher.KindChunk || string(r.Data) != strconv.Itoa(i) {
					t.Fatalf("reply %d: got %+v, %v; want chunk %d", i, r, err, i)
				}
				if i%20 == 0 {
					time.Sleep(5 * time.Millisecond) // fall behind the writers
				}
			}
			if r, err := s.Next(ctx, 5*time.Second); err != nil || r.Kind != dispatcher.KindDone {
				t.Fatalf("got %+v, %v; want done", r, err)
			}
			if err := <-ended; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// testReplies runs the protocol's cases; lossy says the chunks travel over
// NATS, which may lose them.
func testReplies(t *testing.T, nc *nats.Conn, replies *Replies, p string, newWriter func(*nats.Conn, string, int) *Writer, lossy bool) {
	ctx := context.Background()
	next := func(s *Stream) (Reply, error) { return s.Next(ctx, 5*time.Second) }

	// end runs a writer's end concurrently, as a worker does: it waits for
	// the gateway's ack, which the reader sends.
	end := func(t *testing.T, f func() error) {
		errc := make(chan error, 1)
		go func() { errc <- f() }()
		t.Cleanup(func() {
			if err := <-errc; err != nil {
				t.Errorf("end: %v", err)
			}
		})
	}
	// lose makes the writer count a chunk as sent without sending it, as if
	// NATS lost it in transit. In memory nothing is lost: it is sent (for
	// the cases that are not about the loss).
	lose := func(w *Writer, data string) {
		if !lossy {
			w.Chunk([]byte(data))
			return
		}
		w.kept = append(w.kept, []byte(data))
		w.seq++
	}
	want := func(t *testing.T, s *Stream, chunks ...string) {
		t.Helper()
		for _, c := range chunks {
			r, err := next(s)
			if err != nil || r.Kind != dispatcher.KindChunk || string(r.Data) != c {
				t.Fatalf("got %+v, %v; want chunk %q", r, err, c)
			}
		}
	}
	wantKind := func(t *testing.T, s *Stream, kind string) Reply {
		t.Helper()
		r, err := next(s)
		if err != nil || r.Kind != kind {
			t.Fatalf("got %+v, %v; want %s", r, err, kind)
		}
		return r
	}

	t.Run("a writer that beats at once is heard as its decode starts", func(t *testing.T) {
		s, _ := replies.Open(p + "rs")
		defer s.Close()
		started := make(chan struct{}, 4)
		s.OnStarted(func() { started <- struct{}{} })
		got := make(chan error, 1)
		go func() {
			r, err := next(s)
			if err == nil && (r.Kind != dispatcher.KindChunk || string(r.Data) != "a") {
				err = fmt.Errorf("got %+v; want chunk a", r)
			}
			got <- err
		}()
		w := newWriter(nc, replies.Subject(p+"rs"), 1)
		w.BeatAtOnce()
		stop := w.Beats(ctx, time.Hour) // no beat but the first
		defer stop()
		select {
		case <-started:
		case <-time.After(5 * time.Second):
			t.Fatal("the decode was not heard from before its first chunk")
		}
		w.Chunk([]byte("a"))
		if err := <-got; err != nil {
			t.Fatal(err)
		}
		end(t, w.Done)
		wantKind(t, s, dispatcher.KindDone)
		if len(started) != 0 {
			t.Errorf("heard from %d more times; want once", len(started))
		}
	})

	t.Run("a prefill's end starts the request, and no decode is heard from", func(t *testing.T) {
		s, _ := replies.Open(p + "rp")
		defer s.Close()
		s.Start(1)
		started := 0
		s.OnStarted(func() { started++ })
		var on []string
		s.OnPrefilledOn(func(engine string) { on = append(on, engine) })
		subject := replies.Subject(p + "rp")
		// An earlier generation's prefill is not this request's.
		if err := newWriter(nc, subject, dispatcher.ReplyAttempt(0, 0)).Prefilled("e0"); err != nil {
			t.Fatal(err)
		}
		// A worker of an earlier build names no engine.
		if err := newWriter(nc, subject, dispatcher.ReplyAttempt(1, 0)).Prefilled(""); err != nil {
			t.Fatal(err)
		}
		if err := newWriter(nc, subject, dispatcher.ReplyAttempt(1, 0)).Prefilled("e1"); err != nil {
			t.Fatal(err)
		}
		// Nothing but the prefills' ends comes: Next waits for a decode
		// until its stall time, again and again until they are in.
		for deadline := time.Now().Add(5 * time.Second); started < 2 && time.Now().Before(deadline); {
			if r, err := s.Next(ctx, 50*time.Millisecond); !errors.Is(err, ErrStalled) {
				t.Fatalf("got %+v, %v; want a stall", r, err)
			}
		}
		if started != 2 {
			t.Fatalf("started %d times by the prefills' ends; want twice, by this generation's two", started)
		}
		if !slices.Equal(on, []string{"e1"}) {
			t.Errorf("prefilled on %q; want this generation's engine, e1", on)
		}
		if s.Heard() {
			t.Error("a prefill's end was heard as a decode: the stall time-out would run before any decode started")
		}
		w := newWriter(nc, subject, dispatcher.ReplyAttempt(1, 1))
		w.Chunk([]byte("a"))
		want(t, s, "a")
		if started != 3 || !s.Heard() {
			t.Errorf("after the decode's first chunk: started %d times, heard %v; want 3, true", started, s.Heard())
		}
		end(t, w.Done)
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("a writer that does not beat at once is heard at its first chunk", func(t *testing.T) {
		s, _ := replies.Open(p + "rs2")
		defer s.Close()
		started := 0
		s.OnStarted(func() { started++ })
		w := newWriter(nc, replies.Subject(p+"rs2"), 1)
		stop := w.Beats(ctx, time.Hour)
		defer stop()
		w.Chunk([]byte("a"))
		want(t, s, "a")
		if started != 1 {
			t.Errorf("heard from %d times at the first chunk; want once", started)
		}
		end(t, w.Done)
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("chunks in order, then done", func(t *testing.T) {
		s, _ := replies.Open(p + "r1")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r1"), 1)
		for _, c := range []string{"a", "b", "c"} {
			w.Chunk([]byte(c))
		}
		end(t, w.Done)
		want(t, s, "a", "b", "c")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("batched chunks", func(t *testing.T) {
		s, _ := replies.Open(p + "rb1")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"rb1"), 1)
		w.Chunks([][]byte{[]byte("a"), []byte("b"), []byte("c")})
		w.Chunk([]byte("d"))
		w.Chunks([][]byte{[]byte("e"), []byte("f")})
		end(t, w.Done)
		want(t, s, "a", "b", "c", "d", "e", "f")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("a batch partly received before is not repeated", func(t *testing.T) {
		s, _ := replies.Open(p + "rb2")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"rb2"), 1)
		w.Chunks([][]byte{[]byte("a"), []byte("b")})
		// The same chunks again, and one more: as a resend overlapping a
		// later batch would come.
		w.seq = 0
		w.kept = nil
		w.Chunks([][]byte{[]byte("a"), []byte("b"), []byte("c")})
		end(t, w.Done)
		want(t, s, "a", "b", "c")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("a lost batch is sent again", func(t *testing.T) {
		if !lossy {
			t.Skip("nothing is lost in memory")
		}
		s, _ := replies.Open(p + "rb3")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"rb3"), 1)
		w.Chunk([]byte("a"))
		lose(w, "b")
		lose(w, "c")
		w.Chunks([][]byte{[]byte("d"), []byte("e")})
		end(t, w.Done)
		want(t, s, "a", "b", "c", "d", "e")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("a lost chunk is sent again", func(t *testing.T) {
		if !lossy {
			t.Skip("nothing is lost in memory")
		}
		s, _ := replies.Open(p + "r2")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r2"), 1)
		w.Chunk([]byte("a"))
		lose(w, "b")
		w.Chunk([]byte("c"))
		end(t, w.Done)
		want(t, s, "a", "b", "c")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("a lost tail is sent again", func(t *testing.T) {
		if !lossy {
			t.Skip("nothing is lost in memory")
		}
		s, _ := replies.Open(p + "r3")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r3"), 1)
		w.Chunk([]byte("a"))
		lose(w, "b")
		lose(w, "c")
		end(t, w.Done)
		want(t, s, "a", "b", "c")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("beats fill a gap while the decode runs", func(t *testing.T) {
		if !lossy {
			t.Skip("nothing is lost in memory")
		}
		s, _ := replies.Open(p + "r3b")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r3b"), 1)
		w.Chunk([]byte("a"))
		lose(w, "b")
		stop := w.Beats(ctx, 20*time.Millisecond)
		defer stop()
		want(t, s, "a", "b")
		if w.Sent() != 2 || len(w.kept) > 1 {
			t.Errorf("sent %d, kept %d; want 2 sent and at most the unacknowledged one kept", w.Sent(), len(w.kept))
		}
	})

	t.Run("a restart before any output is followed", func(t *testing.T) {
		s, _ := replies.Open(p + "r4")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r4"), 2)
		w.Chunk([]byte("second"))
		// a late message from the superseded attempt is ignored
		newWriter(nc, replies.Subject(p+"r4"), 1).Chunk([]byte("first"))
		end(t, w.Done)
		want(t, s, "second")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("a restart after output is an error", func(t *testing.T) {
		s, _ := replies.Open(p + "r5")
		defer s.Close()
		newWriter(nc, replies.Subject(p+"r5"), 1).Chunk([]byte("a"))
		newWriter(nc, replies.Subject(p+"r5"), 2).Chunk([]byte("a"))
		next(s)
		if _, err := next(s); !errors.Is(err, ErrRestarted) {
			t.Fatalf("err = %v, want ErrRestarted", err)
		}
	})

	t.Run("a moved reply continues in the next attempt", func(t *testing.T) {
		s, _ := replies.Open(p + "r5b")
		defer s.Close()
		first := newWriter(nc, replies.Subject(p+"r5b"), dispatcher.ReplyAttempt(1, 1))
		first.Chunk([]byte("a"))
		lose(first, "b")
		moved := make(chan error, 1)
		go func() { moved <- first.Moved() }()
		want(t, s, "a", "b")
		second := newWriter(nc, replies.Subject(p+"r5b"), dispatcher.ReplyAttempt(2, 1))
		second.ContinueAt(2)
		end(t, func() error {
			if err := <-moved; err != nil {
				return err
			}
			second.Chunk([]byte("c"))
			return second.Done()
		})
		want(t, s, "c")
		wantKind(t, s, dispatcher.KindDone)
	})

	t.Run("errors carry their status", func(t *testing.T) {
		s, _ := replies.Open(p + "r6")
		defer s.Close()
		end(t, func() error {
			return newWriter(nc, replies.Subject(p+"r6"), 0).Error(openai.NewError(400, "too long"))
		})
		r := wantKind(t, s, dispatcher.KindError)
		e, ok := openai.ParseError(r.Data)
		if r.Status != 400 || !ok || e.Message != "too long" {
			t.Fatalf("got %+v", r)
		}
	})

	t.Run("a request that ended here acks its late writers", func(t *testing.T) {
		w := newWriter(nc, replies.Subject(p+"gone"), 1)
		w.Chunk([]byte("a"))
		w.SetEndWait(5 * time.Second)
		if err := w.Done(); err != nil {
			t.Fatalf("done = %v, want an ack from the gateway", err)
		}
	})

	// watch runs a writer's beats with a gone hook and reports whether it
	// was called within wait.
	watch := func(t *testing.T, w *Writer, wanted func(context.Context) bool, wait time.Duration) (gone, superseded bool) {
		told := make(chan bool, 1)
		w.Watch(func(cause error) { told <- errors.Is(cause, ErrSuperseded) }, wanted)
		defer w.Beats(ctx, 20*time.Millisecond)()
		select {
		case sup := <-told:
			return true, sup
		case <-time.After(wait):
			return false, false
		}
	}

	t.Run("a running writer whose request ended here is told it is gone", func(t *testing.T) {
		// Its cancel broadcast lost: the client left, the gateway closed
		// the stream, the worker's engine call goes on.
		s, err := replies.Open(p + "left")
		if err != nil {
			t.Fatal(err)
		}
		w := newWriter(nc, replies.Subject(p+"left"), 1)
		w.Chunk([]byte("a"))
		want(t, s, "a")
		s.Close()
		if gone, sup := watch(t, w, nil, 2*time.Second); !gone || sup {
			t.Fatalf("the writer of a closed stream: gone %v, superseded %v; want told it is gone, the request ended", gone, sup)
		}
	})

	t.Run("a stream follows its own generation, not an earlier one's writer", func(t *testing.T) {
		s, err := replies.Open(p + "gen2")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		s.Start(2)
		stale := newWriter(nc, replies.Subject(p+"gen2"), dispatcher.ReplyAttempt(1, 1))
		stale.Chunk([]byte("stale"))
		own := newWriter(nc, replies.Subject(p+"gen2"), dispatcher.ReplyAttempt(2, 1))
		own.Chunk([]byte("own"))
		want(t, s, "own")
		if gone, sup := watch(t, stale, nil, 2*time.Second); !gone || !sup {
			t.Errorf("a writer of an earlier generation: gone %v, superseded %v; want told a later attempt runs", gone, sup)
		}
	})

	t.Run("a running writer whose request is held is not gone", func(t *testing.T) {
		s, err := replies.Open(p + "held")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"held"), 1)
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go func() {
			for rctx.Err() == nil {
				s.Next(rctx, 5*time.Second) // acks the beats
			}
		}()
		if gone, _ := watch(t, w, func(context.Context) bool { return true }, 300*time.Millisecond); gone {
			t.Fatal("a writer whose request the gateway holds was told it is gone")
		}
	})

	if lossy {
		t.Run("a writer whose beats get no answer asks the record", func(t *testing.T) {
			for _, wanted := range []bool{true, false} {
				w := newWriter(nc, dispatcher.ReplySubject("no-gateway", p+"doubt"), 1)
				var asked atomic.Int32
				gone, _ := watch(t, w, func(context.Context) bool { asked.Add(1); return wanted }, 300*time.Millisecond)
				if gone == wanted || asked.Load() == 0 {
					t.Errorf("record wants the work: %v, asked %d times; the writer was told it is gone: %v", wanted, asked.Load(), gone)
				}
			}
		})
	}

	t.Run("an end nobody acknowledges gives up", func(t *testing.T) {
		w := newWriter(nc, dispatcher.ReplySubject("no-gateway", p+"x"), 1)
		w.SetEndWait(300 * time.Millisecond)
		if err := w.Done(); !errors.Is(err, ErrUnacked) {
			t.Fatalf("done = %v, want ErrUnacked", err)
		}
	})

	t.Run("in flight ids are refused", func(t *testing.T) {
		s, err := replies.Open(p + "r7")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := replies.Open(p + "r7"); !errors.Is(err, ErrInFlight) {
			t.Fatalf("second Open = %v, want ErrInFlight", err)
		}
		s.Close()
		if s2, err := replies.Open(p + "r7"); err != nil {
			t.Fatalf("Open after Close = %v", err)
		} else {
			s2.Close()
		}
	})

	t.Run("silence before a decode starts is no stall", func(t *testing.T) {
		s, _ := replies.Open(p + "r8")
		defer s.Close()
		if _, err := s.Next(ctx, 50*time.Millisecond); !errors.Is(err, ErrStalled) || s.Heard() {
			t.Fatalf("err = %v, heard %v; want a stall with no decode heard: a queued request is silent", err, s.Heard())
		}
	})

	t.Run("a running decode that goes silent stalls", func(t *testing.T) {
		s, _ := replies.Open(p + "r8b")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r8b"), 1)
		w.Chunk([]byte("a"))
		if _, err := s.Next(ctx, 100*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Next(ctx, 100*time.Millisecond); !errors.Is(err, ErrStalled) || !s.Heard() {
			t.Fatalf("err = %v, heard %v; want ErrStalled from a decode heard", err, s.Heard())
		}
	})

	t.Run("beats keep a silent decode alive", func(t *testing.T) {
		s, _ := replies.Open(p + "r8c")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r8c"), 1)
		w.Chunk([]byte("a"))
		if _, err := s.Next(ctx, 150*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		stop := w.Beats(ctx, 20*time.Millisecond)
		defer stop()
		time.AfterFunc(time.Second, func() { w.Chunk([]byte("b")) })
		if r, err := s.Next(ctx, 300*time.Millisecond); err != nil || string(r.Data) != "b" {
			t.Fatalf("got %+v, %v; want chunk b after 1 s of beats, with no stall", r, err)
		}
	})

	t.Run("overflow is a gap", func(t *testing.T) {
		s, _ := replies.Open(p + "r9")
		defer s.Close()
		w := newWriter(nc, replies.Subject(p+"r9"), 1)
		for i := range replyBuffer + 10 {
			w.Chunk([]byte(strconv.Itoa(i)))
		}
		nc.Flush()
		deadline := time.Now().Add(5 * time.Second)
		for !s.overflow.Load() && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
		if _, err := next(s); !errors.Is(err, ErrGap) {
			t.Fatalf("err = %v, want ErrGap after an overflow", err)
		}
	})

}

func TestReplyQueue(t *testing.T) {
	q := newReplyQueue(nil)
	// A relay that stays one message behind for a long stream: the queue
	// holds little and does not grow with the stream.
	q.push(&nats.Msg{Subject: "0"})
	for i := 1; i <= 100_000; i++ {
		q.push(&nats.Msg{Subject: strconv.Itoa(i)})
		m, ok := q.pop()
		if !ok || m.Subject != strconv.Itoa(i-1) {
			t.Fatalf("pop %d: %v, %v", i, m, ok)
		}
	}
	if q.len() != 1 || cap(q.msgs) > 1024 {
		t.Errorf("holding %d, the queue's slice has room for %d", q.len(), cap(q.msgs))
	}
	for range replyBuffer + 10 {
		q.push(&nats.Msg{})
	}
	if q.len() != replyBuffer {
		t.Errorf("a full queue holds %d, want %d", q.len(), replyBuffer)
	}
	for q.len() > 0 {
		q.pop()
	}
	if q.msgs != nil {
		t.Errorf("a drained queue keeps room for %d after a burst", cap(q.msgs))
	}
}

// testBudget is a Budget of limit bytes.
type testBudget struct{ limit, used int64 }

func (b *testBudget) Take(n int64) bool {
	if b.used+n > b.limit {
		return false
	}
	b.used += n
	return true
}
func (b *testBudget) Release(n int64) { b.used -= n }

// TestReplyQueueBytes: a request's replies are bounded in bytes, a
// stream's and a whole answer's, and what they hold is counted in the
// gateway's budget until read or dropped.
func TestReplyQueueBytes(t *testing.T) {
	big := &nats.Msg{Data: make([]byte, 6<<20)}
	q := newReplyQueue(nil)
	took := 0
	for range 3 {
		if q.push(big) {
			took++
		}
	}
	if took != 2 {
		t.Errorf("a stream's queue took %d replies of 6 MiB, want 2: its bound is %d bytes", took, streamReplyBytes)
	}
	q = newReplyQueue(nil)
	q.limit = wholeReplyBytes
	for i := range MaxWholeAnswer / (4 << 20) {
		if !q.push(&nats.Msg{Data: make([]byte, 4<<20)}) {
			t.Fatalf("a whole answer's queue refused part %d of the largest answer", i)
		}
	}

	// Past its allowance a queue draws on the budget: 6 MiB held is 5 of
	// the budget's 10, and 12 would be 11.
	budget := &testBudget{limit: 10 << 20}
	q = newReplyQueue(budget)
	if !q.push(big) || q.push(big) {
		t.Fatal("a queue took replies past the gateway's budget, or not the first")
	}
	if budget.used != 5<<20 {
		t.Errorf("the budget counts %d bytes, want the 5 MiB held past the allowance", budget.used)
	}
	q.pop()
	if budget.used != 0 || !q.push(big) || budget.used != 5<<20 {
		t.Errorf("after a read and a new reply the budget counts %d, want 5 MiB", budget.used)
	}
	// A request that keeps up (a little at a time) never meets the
	// budget, spent as it may be.
	spent := &testBudget{}
	q2 := newReplyQueue(spent)
	for range 1000 {
		if !q2.push(&nats.Msg{Data: make([]byte, 512)}) {
			t.Fatal("a queue holding little was refused for a budget spent by others")
		}
		q2.pop()
	}
	q.close()
	if budget.used != 0 || !q.push(big) || budget.used != 0 {
		t.Errorf("a closed queue holds %d bytes of the budget, want none", budget.used)
	}
}

// TestSlowFlushIsNotAStall: a flush that blocks longer than the stall
// time-out (a client that does not read) is no silence of the decode's:
// the chunk that came meanwhile is returned. (Found by review.)
func TestSlowFlushIsNotAStall(t *testing.T) {
	chunk := func(seq int) *nats.Msg {
		m := nats.NewMsg("x")
		m.Header[dispatcher.HeaderKind] = []string{dispatcher.KindChunk}
		m.Header[dispatcher.HeaderSeq] = []string{strconv.Itoa(seq)}
		m.Header[dispatcher.HeaderAttempt] = []string{"0"}
		m.Data = []byte("c")
		return m
	}
	for i := range 10 {
		s := &Stream{id: "r", q: newReplyQueue(nil), heard: true}
		s.q.push(chunk(0))
		if _, err := s.Next(context.Background(), 50*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		s.OnIdle(func() error {
			s.q.push(chunk(1)) // the decode goes on while the client is slow
			time.Sleep(100 * time.Millisecond)
			return nil
		})
		if _, err := s.Next(context.Background(), 50*time.Millisecond); err != nil {
			t.Fatalf("run %d: %v, with a chunk waiting", i, err)
		}
	}
}

// TestReplyFrame checks the framed chunk: what a writer sends carries no
// headers and reads back as it was sent, a chunk with newlines included;
// a payload that is not a frame is a gap, not a chunk.
func TestReplyFrame(t *testing.T) {
	nc, _ := dispatchertest.JetStream(t)
	raw, err := nc.SubscribeSync("frames")
	if err != nil {
		t.Fatal(err)
	}
	w := NewWriter(nc, "frames", dispatcher.ReplyAttempt(3, 2))
	w.Frame()
	w.Chunk([]byte("one\nline, two"))
	w.Chunks([][]byte{[]byte(`{"a":1}`), nil, []byte("z")})
	for _, want := range []struct {
		seq, count int
		data       string
	}{{0, 1, "one\nline, two"}, {1, 3, "{\"a\":1}\n\nz"}} {
		m, err := raw.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Header) != 0 {
			t.Errorf("a framed chunk came with headers %v", m.Header)
		}
		kind, attempt, seq, count, data, err := replyOf(m)
		if err != nil || kind != dispatcher.KindChunk || attempt != dispatcher.ReplyAttempt(3, 2) || seq != want.seq || count != want.count || string(data) != want.data {
			t.Errorf("read %q as %s attempt %d seq %d count %d data %q (%v); want chunk attempt %d seq %d count %d data %q",
				m.Data, kind, attempt, seq, count, data, err, dispatcher.ReplyAttempt(3, 2), want.seq, want.count, want.data)
		}
	}
	for _, bad := range []string{"", "no frame", "1 2 3", "1 2\nx", "1 2 0\nx", "1 -2 1\nx", "a 2 1\nx", "1  2 1\nx", "1 2 1 4\nx"} {
		if _, _, _, _, _, err := replyOf(&nats.Msg{Data: []byte(bad)}); !errors.Is(err, ErrGap) {
			t.Errorf("%q read as a reply (%v); want ErrGap", bad, err)
		}
	}
}

// FuzzReplyFrame checks the frame both ways: what a writer frames reads
// back exactly, and any payload either reads as a frame that writes back
// to itself or is refused, never misread.
func FuzzReplyFrame(f *testing.F) {
	f.Add(257, 3, []byte("a"), []byte(`{"x":1}`), []byte("1 2 1\nz"))
	f.Add(0, 0, []byte(""), []byte("\n"), []byte("9 9 2\na\nb"))
	f.Fuzz(func(t *testing.T, attempt, seq int, one, other, payload []byte) {
		if attempt < 0 || seq < 0 || bytes.IndexByte(one, '\n') >= 0 || bytes.IndexByte(other, '\n') >= 0 {
			return
		}
		w := &Writer{attemptN: attempt}
		a, s, c, data, ok := parseFrame(w.frame(seq, one, other))
		if !ok || a != attempt || s != seq || c != 2 || string(data) != string(one)+"\n"+string(other) {
			t.Fatalf("frame(%d, %d, %q, %q) read back as %d %d %d %q %v", attempt, seq, one, other, a, s, c, data, ok)
		}
		a, s, c, data, ok = parseFrame(payload)
		if !ok {
			return
		}
		if c < 1 || a < 0 || s < 0 {
			t.Fatalf("%q read as attempt %d, seq %d, count %d", payload, a, s, c)
		}
		// The reader takes a line of exactly three numbers, the ones it
		// returns, and the data after it.
		line := string(payload[:len(payload)-len(data)-1])
		f := strings.Split(line, " ")
		if len(f) != 3 || fmt.Sprint(atoiOr(f[0]), atoiOr(f[1]), atoiOr(f[2])) != fmt.Sprint(a, s, c) {
			t.Fatalf("%q read as attempt %d, seq %d, count %d from the line %q", payload, a, s, c, line)
		}
	})
}

func atoiOr(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return -1
	}
	return n
}
