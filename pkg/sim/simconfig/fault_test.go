package simconfig

import "testing"

func TestFaultDraw(t *testing.T) {
	f := NewFaultInjector(Fault{Rate: 0.25, Kind: Fault500}, DefaultConfig().Seed)
	hits := 0
	for range 4000 {
		if k, _ := f.Draw(); k == Fault500 {
			hits++
		}
	}
	if hits < 800 || hits > 1200 {
		t.Errorf("%d of 4000 at rate 0.25", hits)
	}
	f.Set(Fault{Rate: 1, Kind: FaultSlow, Delay: Duration(3e9)})
	if k, d := f.Draw(); k != FaultSlow || d != 3e9 {
		t.Errorf("draw = %v %v", k, d)
	}
	f.Set(Fault{})
	if k, _ := f.Draw(); k != FaultNone {
		t.Errorf("rate 0 drew %v", k)
	}
}
