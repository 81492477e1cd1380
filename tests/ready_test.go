package tests

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
)

// TestReadyWhileCannotSubmit: /ready says 503 whenever a submit would
// fail for want of a stream or the request records, and 200 once they are
// back. (A NATS that is down is the fault suite's nats-server restart.)
func TestReadyWhileCannotSubmit(t *testing.T) {
	p := startPipeline(t, pipelineOptions{})
	ctx := context.Background()
	get(t, p.url+"/ready").wantStatus(t, http.StatusOK)
	for _, lose := range []struct {
		name string
		drop func() error
	}{
		{dispatcher.StreamDecode, func() error { return p.js.DeleteStream(ctx, dispatcher.StreamDecode) }},
		{dispatcher.BucketRequests, func() error { return p.js.DeleteKeyValue(ctx, dispatcher.BucketRequests) }},
	} {
		if err := lose.drop(); err != nil {
			t.Fatal(err)
		}
		r := get(t, p.url+"/ready")
		if r.status != http.StatusServiceUnavailable || !strings.Contains(r.apiError(t).Message, lose.name) {
			t.Errorf("/ready without %s: %d %s; want a 503 naming it", lose.name, r.status, r.body)
		}
		if err := dispatcher.Ensure(ctx, p.js); err != nil {
			t.Fatal(err)
		}
		get(t, p.url+"/ready").wantStatus(t, http.StatusOK)
	}
}
