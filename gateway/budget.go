package gateway

import "sync"

// byteBudget bounds the request bytes the gateway holds at once, so that
// many large requests (or clients that send one and leave) cannot run it
// out of memory: past the bound, a request gets a 429 instead.
type byteBudget struct {
	mu    sync.Mutex
	limit int64
	used  int64
}

func newByteBudget(limit int64) *byteBudget { return &byteBudget{limit: limit} }

// take reserves n bytes if they fit.
func (b *byteBudget) take(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.limit {
		return false
	}
	b.used += n
	return true
}

// release returns n reserved bytes.
func (b *byteBudget) release(n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
}
