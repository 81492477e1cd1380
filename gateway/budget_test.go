package gateway

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

func TestBudgetReader(t *testing.T) {
	b := newByteBudget(256<<10, nil)
	small := &budgetReader{r: bytes.NewReader(make([]byte, 100<<10)), budget: b}
	if _, err := io.ReadAll(small); err != nil {
		t.Fatalf("a body within the budget: %v", err)
	}
	if small.taken < 100<<10 {
		t.Errorf("took %d bytes of budget for a 100 KiB body", small.taken)
	}
	big := &budgetReader{r: bytes.NewReader(make([]byte, 300<<10)), budget: b}
	if _, err := io.ReadAll(big); !errors.Is(err, errOverBudget) {
		t.Fatalf("a chunked body over what is left of the budget: err %v, want errOverBudget", err)
	}
	b.release(big.taken)
	b.release(small.taken)
	if n := b.used.Load(); n != 0 {
		t.Errorf("%d bytes still counted after every body was released", n)
	}
}

// TestBudgetReaderEdge: a chunked body just under the limit fits, although
// the 64 KiB reservation steps would overshoot it.
func TestBudgetReaderEdge(t *testing.T) {
	const limit = 1 << 20
	b := newByteBudget(limit, nil)
	r := &budgetReader{r: bytes.NewReader(make([]byte, limit-1000)), budget: b}
	if _, err := io.ReadAll(r); err != nil {
		t.Fatalf("a chunked body of limit-1000 bytes on an idle gateway: %v", err)
	}
	if r.taken > limit {
		t.Errorf("took %d bytes of a %d budget", r.taken, limit)
	}
}
