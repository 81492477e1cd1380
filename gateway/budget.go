package gateway

import (
	"sync/atomic"

	"github.com/pdq-dev/pdq/dispatcher"
)

// byteBudget bounds the request bytes the gateway holds at once, so that
// many large requests (or clients that send one and leave) cannot run it
// out of memory: past the bound, a request gets a 429 instead. The reply
// bytes waiting for slow clients count too (dispatcher.Budget), taken and
// given back once per reply message: it is an atomic count, not a lock.
// What it holds is pdq_gateway_inflight_bytes.
//
// take and release are called by request handlers and relays; Take and
// Release by the reply queues, from the reply subscription's goroutine
// and, in pdq up, the workers' goroutines: any number at once.
type byteBudget struct {
	limit   int64 // set by newByteBudget
	used    atomic.Int64
	metrics *dispatcher.Metrics // set by newByteBudget; nil counts nothing
}

func newByteBudget(limit int64, metrics *dispatcher.Metrics) *byteBudget {
	return &byteBudget{limit: limit, metrics: metrics}
}

// take reserves n bytes if they fit. Two takes at once may each see the
// other's bytes and one fail that alone would fit: a bound, not a queue.
func (b *byteBudget) take(n int64) bool {
	if n == 0 {
		return true
	}
	if b.used.Add(n) > b.limit {
		b.used.Add(-n)
		return false
	}
	b.metrics.GatewayBytes(n)
	return true
}

// release returns n reserved bytes.
func (b *byteBudget) release(n int64) {
	if n != 0 {
		b.used.Add(-n)
		b.metrics.GatewayBytes(-n)
	}
}

// Take and Release are take and release for the reply queues
// (dispatcher.Budget).
func (b *byteBudget) Take(n int64) bool { return b.take(n) }
func (b *byteBudget) Release(n int64)   { b.release(n) }
