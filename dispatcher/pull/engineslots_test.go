package pull

import (
	"context"
	"testing"
	"time"
)

func TestEngineSlotsWait(t *testing.T) {
	ctx := context.Background()
	e := NewEngineSlots(2)
	for range 2 {
		if err := e.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if e.WaitFree(short) == nil {
		t.Fatal("a full engine looked free")
	}
	got := make(chan error, 1)
	go func() { got <- e.Acquire(ctx) }()
	e.Release()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a freed slot was not taken")
	}
	e.Release()
	if err := e.WaitFree(ctx); err != nil {
		t.Fatal(err)
	}
	if e.InUse() != 1 {
		t.Errorf("waitFree took a slot: %d used", e.InUse())
	}
}

// TestEngineSlotsLimit: a lowered limit lets the jobs running beyond it
// finish but starts none until fewer run; a raised one wakes the jobs that
// wait at once; the limit stays within 1 and the slots made; the seats
// reported are never more than the limit.
func TestEngineSlotsLimit(t *testing.T) {
	ctx := context.Background()
	e := NewEngineSlots(4)
	for range 3 {
		if !e.TryAcquire() {
			t.Fatal("a free slot refused")
		}
	}
	e.SetLimit(2, 1)
	if used, limit, most := e.Load(); used != 3 || limit != 2 || most != 4 || e.Seats() != 1 {
		t.Errorf("Load() = %d, %d, %d, seats %d; want 3, 2, 4 and 1", used, limit, most, e.Seats())
	}
	e.Release()
	if e.TryAcquire() {
		t.Fatal("a slot taken at the limit")
	}
	got := make(chan error, 1)
	go func() { got <- e.Acquire(ctx) }()
	select {
	case err := <-got:
		t.Fatalf("a slot taken at the limit: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	e.SetLimit(3, 0)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a raised limit did not wake the job waiting for a slot")
	}
	for _, tc := range []struct{ n, seats, limit, wantSeats int }{
		{0, 0, 1, 1},
		{99, 0, 4, 4},
		{3, 7, 3, 3},
		{3, 2, 3, 2},
	} {
		e.SetLimit(tc.n, tc.seats)
		if _, limit, _ := e.Load(); limit != tc.limit || e.Seats() != tc.wantSeats {
			t.Errorf("SetLimit(%d, %d): limit %d, seats %d; want %d and %d", tc.n, tc.seats, limit, e.Seats(), tc.limit, tc.wantSeats)
		}
	}
}
