// Package sleep waits with a context: every loop in pdq that backs off or
// polls sleeps this way, so that a stop never waits out a back-off.
package sleep

import (
	"context"
	"time"
)

// For sleeps for d, or until ctx ends, and then returns ctx's error.
func For(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
