package sim

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
)

func TestKVStore(t *testing.T) {
	t.Run("hold, read, release", func(t *testing.T) {
		var c counters
		s := newKVStore(logging.Discard(), &c, time.Hour)
		defer s.close()
		a := s.hold("a", "ext-a", 3, 40, "da")
		b := s.hold("b", "ext-b", 2, 20, "db")
		if len(a) != 3 || len(b) != 2 || slices.ContainsFunc(b, func(x int) bool { return slices.Contains(a, x) }) {
			t.Fatalf("blocks a=%v b=%v overlap or have the wrong size", a, b)
		}
		if c.blocksHeld.Load() != 5 {
			t.Errorf("blocksHeld = %d", c.blocksHeld.Load())
		}
		h, err := s.read("a", a)
		if err != nil || h.digest != "da" || h.externalID != "ext-a" || h.numTokens != 40 {
			t.Errorf("read = %+v, %v", h, err)
		}
		if _, err := s.read("a", b); !errors.Is(err, errBlockMismatch) {
			t.Errorf("read with b's blocks: %v", err)
		}
		if _, err := s.read("nope", a); !errors.Is(err, errUnknownRequest) {
			t.Errorf("read unknown: %v", err)
		}
		if !s.release("a") || s.release("a") {
			t.Error("release must succeed once")
		}
		if c.blocksHeld.Load() != 2 {
			t.Errorf("blocksHeld = %d after release", c.blocksHeld.Load())
		}
		again := s.hold("c", "", 3, 48, "dc")
		slices.Sort(again)
		slices.Sort(a)
		if !slices.Equal(again, a) {
			t.Errorf("freed blocks %v not reused, got %v", a, again)
		}
	})

	t.Run("lease expiry and extension", func(t *testing.T) {
		var c counters
		s := newKVStore(logging.Discard(), &c, 80*time.Millisecond)
		defer s.close()
		s.hold("old", "", 2, 20, "d1")
		s.hold("kept", "", 1, 10, "d2")
		stop := time.After(300 * time.Millisecond)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
	loop:
		for {
			select {
			case <-tick.C:
				if !s.extend("kept") {
					t.Fatal("extend failed on a held request")
				}
			case <-stop:
				break loop
			}
		}
		if _, err := s.read("old", nil); !errors.Is(err, errUnknownRequest) {
			t.Errorf("the unextended hold is still there: %v", err)
		}
		if c.blocksExpired.Load() != 2 || c.holdsExpired.Load() != 1 || c.blocksHeld.Load() != 1 {
			t.Errorf("expired %d blocks, %d holds, %d held; want 2, 1, 1", c.blocksExpired.Load(), c.holdsExpired.Load(), c.blocksHeld.Load())
		}
		if s.extend("old") {
			t.Error("extended an expired hold")
		}
	})

	t.Run("reused id replaces the old hold", func(t *testing.T) {
		var c counters
		s := newKVStore(logging.Discard(), &c, time.Hour)
		defer s.close()
		s.hold("x", "", 2, 20, "d1")
		b := s.hold("x", "", 1, 10, "d2")
		if c.blocksHeld.Load() != 1 {
			t.Errorf("blocksHeld = %d", c.blocksHeld.Load())
		}
		if h, err := s.read("x", b); err != nil || h.digest != "d2" {
			t.Errorf("read = %+v, %v", h, err)
		}
	})
}
