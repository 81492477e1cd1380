package workers

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
)

// TestRelayBodyLimit: a non-streamed answer over the most pdq relays whole
// is an error that says so, not retried (a retry would meet it again) and
// not cut short silently.
func TestRelayBodyLimit(t *testing.T) {
	answer := io.MultiReader(io.LimitReader(zeros{}, maxResponseBytes), strings.NewReader("!"))
	err := relayBody(context.Background(), answer, reply.NewWriter(nil, "", 1))
	var f *verdict.Failure
	if !errors.As(err, &f) || !f.Permanent || f.Client == nil || !strings.Contains(f.Client.Message, "larger than") {
		t.Fatalf("relayBody of %d bytes = %v, want a permanent error that names the limit", maxResponseBytes+1, err)
	}
}

// zeros reads as an endless run of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

func TestRetryAfter(t *testing.T) {
	for _, tc := range []struct {
		header string
		want   time.Duration
	}{
		{"", 0},
		{"2", 2 * time.Second},
		{" 3 ", 3 * time.Second},
		{"-1", 0},
		{"soon", 0},
		{time.Now().Add(time.Hour).UTC().Format(http.TimeFormat), time.Hour},
		{"Mon, 01 Jan 2001 00:00:00 GMT", 0},
	} {
		got := retryAfter(tc.header)
		if got < tc.want-2*time.Second || got > tc.want {
			t.Errorf("Retry-After %q: %v, want %v", tc.header, got, tc.want)
		}
	}
}
