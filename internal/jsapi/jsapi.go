// Package jsapi holds what pdq needs to call JetStream's API directly, for
// the two calls the jetstream client makes too slow or cannot make: a pull
// request on a kept subscription, and a direct get of a record. The client
// keeps these settings to itself, so they are read back here.
package jsapi

import (
	"context"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Prefix is the prefix of JetStream's API subjects for o.
func Prefix(o jetstream.JetStreamOptions) string {
	switch {
	case o.APIPrefix != "":
		return strings.TrimSuffix(o.APIPrefix, ".") + "."
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	}
	return jetstream.DefaultAPIPrefix
}

// Timeout is how long the jetstream client waits for an answer to a call
// whose context has no deadline.
func Timeout(o jetstream.JetStreamOptions) time.Duration {
	if o.DefaultTimeout > 0 {
		return o.DefaultTimeout
	}
	return 5 * time.Second // the jetstream client's default
}

// Bounded is ctx, bounded by timeout when it has no deadline of its own, as
// the jetstream client bounds its calls: an answer lost to a reconnect would
// otherwise hold its caller for good.
func Bounded(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, timeout)
}
