package dispatcher

import (
	"testing"
	"time"
)

func TestRetryDelay(t *testing.T) {
	for attempt, want := range map[int]time.Duration{1: 250 * time.Millisecond, 2: time.Second, 3: 4 * time.Second, 4: 10 * time.Second, 9: 10 * time.Second} {
		if got := retryDelay(DefaultRetryBase, attempt); got != want {
			t.Errorf("retryDelay(%d) = %v, want %v", attempt, got, want)
		}
	}
}
