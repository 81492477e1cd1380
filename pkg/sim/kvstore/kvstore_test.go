package kvstore

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
)

func TestKVStore(t *testing.T) {
	t.Run("hold, read, release", func(t *testing.T) {
		var c Counters
		s := New(logging.Discard(), &c, time.Hour)
		defer s.Close()
		a := s.Hold("a", "ext-a", 3, 40, "da", nil)
		b := s.Hold("b", "ext-b", 2, 20, "db", nil)
		if len(a) != 3 || len(b) != 2 || slices.ContainsFunc(b, func(x int) bool { return slices.Contains(a, x) }) {
			t.Fatalf("blocks a=%v b=%v overlap or have the wrong size", a, b)
		}
		if c.BlocksHeld.Load() != 5 {
			t.Errorf("blocksHeld = %d", c.BlocksHeld.Load())
		}
		h, err := s.Read("a", a)
		if err != nil || h.Digest != "da" || h.ExternalID != "ext-a" || h.NumTokens != 40 {
			t.Errorf("read = %+v, %v", h, err)
		}
		if _, err := s.Read("a", b); !errors.Is(err, ErrBlockMismatch) {
			t.Errorf("read with b's blocks: %v", err)
		}
		if _, err := s.Read("nope", a); !errors.Is(err, ErrUnknownRequest) {
			t.Errorf("read unknown: %v", err)
		}
		if !s.Release("a") || s.Release("a") {
			t.Error("release must succeed once")
		}
		if c.BlocksHeld.Load() != 2 {
			t.Errorf("blocksHeld = %d after release", c.BlocksHeld.Load())
		}
		again := s.Hold("c", "", 3, 48, "dc", nil)
		slices.Sort(again)
		slices.Sort(a)
		if !slices.Equal(again, a) {
			t.Errorf("freed blocks %v not reused, got %v", a, again)
		}
	})

	t.Run("freed is called once, however the blocks go", func(t *testing.T) {
		var c Counters
		s := New(logging.Discard(), &c, 50*time.Millisecond)
		freed := map[string]int{}
		var mu sync.Mutex
		hold := func(id string) {
			s.Hold(id, "", 1, 16, "d", func() { mu.Lock(); freed[id]++; mu.Unlock() })
		}
		hold("read")
		hold("expired")
		hold("replaced")
		s.Release("read")
		hold("replaced")
		time.Sleep(200 * time.Millisecond) // "expired" and the second "replaced" expire
		hold("closed")
		s.Close()
		mu.Lock()
		defer mu.Unlock()
		for id, want := range map[string]int{"read": 1, "expired": 1, "replaced": 2, "closed": 1} {
			if freed[id] != want {
				t.Errorf("%s: freed called %d times, want %d", id, freed[id], want)
			}
		}
	})

	t.Run("lease expiry and extension", func(t *testing.T) {
		var c Counters
		s := New(logging.Discard(), &c, 80*time.Millisecond)
		defer s.Close()
		s.Hold("old", "", 2, 20, "d1", nil)
		s.Hold("kept", "", 1, 10, "d2", nil)
		stop := time.After(300 * time.Millisecond)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
	loop:
		for {
			select {
			case <-tick.C:
				if !s.Extend("kept") {
					t.Fatal("extend failed on a held request")
				}
			case <-stop:
				break loop
			}
		}
		if _, err := s.Read("old", nil); !errors.Is(err, ErrUnknownRequest) {
			t.Errorf("the unextended hold is still there: %v", err)
		}
		if c.BlocksExpired.Load() != 2 || c.HoldsExpired.Load() != 1 || c.BlocksHeld.Load() != 1 {
			t.Errorf("expired %d blocks, %d holds, %d held; want 2, 1, 1", c.BlocksExpired.Load(), c.HoldsExpired.Load(), c.BlocksHeld.Load())
		}
		if s.Extend("old") {
			t.Error("extended an expired hold")
		}
	})

	t.Run("reused id replaces the old hold", func(t *testing.T) {
		var c Counters
		s := New(logging.Discard(), &c, time.Hour)
		defer s.Close()
		s.Hold("x", "", 2, 20, "d1", nil)
		b := s.Hold("x", "", 1, 10, "d2", nil)
		if c.BlocksHeld.Load() != 1 {
			t.Errorf("blocksHeld = %d", c.BlocksHeld.Load())
		}
		if h, err := s.Read("x", b); err != nil || h.Digest != "d2" {
			t.Errorf("read = %+v, %v", h, err)
		}
	})
}
