package dispatcher

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

func TestReplies(t *testing.T) {
	nc, _ := startJetStream(t)
	replies, err := NewReplies(nc, "gw1")
	if err != nil {
		t.Fatal(err)
	}
	defer replies.Close()
	ctx := context.Background()
	next := func(s *ReplyStream) (Reply, error) { return s.Next(ctx, 5*time.Second) }

	t.Run("chunks in order, then done", func(t *testing.T) {
		s, _ := replies.Open("r1")
		defer s.Close()
		w := NewReplyWriter(nc, replies.Subject("r1"), 1)
		for _, c := range []string{"a", "b", "c"} {
			w.Chunk([]byte(c))
		}
		w.Done()
		for _, want := range []string{"a", "b", "c"} {
			r, err := next(s)
			if err != nil || r.Kind != KindChunk || string(r.Data) != want {
				t.Fatalf("got %+v, %v; want chunk %q", r, err, want)
			}
		}
		if r, err := next(s); err != nil || r.Kind != KindDone {
			t.Fatalf("got %+v, %v; want done", r, err)
		}
	})

	t.Run("a lost chunk is an error", func(t *testing.T) {
		s, _ := replies.Open("r2")
		defer s.Close()
		w := NewReplyWriter(nc, replies.Subject("r2"), 1)
		w.Chunk([]byte("a"))
		w.seq++ // chunk 1 is lost in transit
		w.Chunk([]byte("c"))
		next(s)
		if _, err := next(s); !errors.Is(err, ErrReplyGap) {
			t.Fatalf("err = %v, want ErrReplyGap", err)
		}
	})

	t.Run("a lost last chunk is an error at done", func(t *testing.T) {
		s, _ := replies.Open("r3")
		defer s.Close()
		w := NewReplyWriter(nc, replies.Subject("r3"), 1)
		w.Chunk([]byte("a"))
		w.seq++
		w.Done()
		next(s)
		if _, err := next(s); !errors.Is(err, ErrReplyGap) {
			t.Fatalf("err = %v, want ErrReplyGap", err)
		}
	})

	t.Run("a restart before any output is followed", func(t *testing.T) {
		s, _ := replies.Open("r4")
		defer s.Close()
		NewReplyWriter(nc, replies.Subject("r4"), 2).Chunk([]byte("second"))
		// a late message from the superseded attempt is ignored
		NewReplyWriter(nc, replies.Subject("r4"), 1).Chunk([]byte("first"))
		w := NewReplyWriter(nc, replies.Subject("r4"), 2)
		w.seq = 1
		w.Done()
		if r, err := next(s); err != nil || string(r.Data) != "second" {
			t.Fatalf("got %+v, %v", r, err)
		}
		if r, err := next(s); err != nil || r.Kind != KindDone {
			t.Fatalf("got %+v, %v; want done", r, err)
		}
	})

	t.Run("a restart after output is an error", func(t *testing.T) {
		s, _ := replies.Open("r5")
		defer s.Close()
		NewReplyWriter(nc, replies.Subject("r5"), 1).Chunk([]byte("a"))
		NewReplyWriter(nc, replies.Subject("r5"), 2).Chunk([]byte("a"))
		next(s)
		if _, err := next(s); !errors.Is(err, ErrReplyRestarted) {
			t.Fatalf("err = %v, want ErrReplyRestarted", err)
		}
	})

	t.Run("errors carry their status", func(t *testing.T) {
		s, _ := replies.Open("r6")
		defer s.Close()
		NewReplyWriter(nc, replies.Subject("r6"), 0).Error(openai.NewError(400, "too long"))
		r, err := next(s)
		e, ok := openai.ParseError(r.Data)
		if err != nil || r.Kind != KindError || r.Status != 400 || !ok || e.Message != "too long" {
			t.Fatalf("got %+v, %v", r, err)
		}
	})

	t.Run("in flight ids are refused", func(t *testing.T) {
		s, err := replies.Open("r7")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := replies.Open("r7"); !errors.Is(err, ErrInFlight) {
			t.Fatalf("second Open = %v, want ErrInFlight", err)
		}
		s.Close()
		if s2, err := replies.Open("r7"); err != nil {
			t.Fatalf("Open after Close = %v", err)
		} else {
			s2.Close()
		}
	})

	t.Run("silence times out", func(t *testing.T) {
		s, _ := replies.Open("r8")
		defer s.Close()
		if _, err := s.Next(ctx, 50*time.Millisecond); !errors.Is(err, ErrReplyTimeout) {
			t.Fatalf("err = %v, want ErrReplyTimeout", err)
		}
	})

	t.Run("overflow is a gap", func(t *testing.T) {
		s, _ := replies.Open("r9")
		defer s.Close()
		w := NewReplyWriter(nc, replies.Subject("r9"), 1)
		for i := range replyBuffer + 10 {
			w.Chunk([]byte(strconv.Itoa(i)))
		}
		nc.Flush()
		deadline := time.Now().Add(5 * time.Second)
		for len(s.ch) < replyBuffer && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
		if _, err := next(s); !errors.Is(err, ErrReplyGap) {
			t.Fatalf("err = %v, want ErrReplyGap after an overflow", err)
		}
	})

}
