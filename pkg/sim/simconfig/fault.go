package simconfig

import (
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"time"
)

// FaultKind is a kind of injected failure.
type FaultKind string

// The fault kinds. See [Fault].
const (
	FaultNone FaultKind = ""
	Fault503  FaultKind = "503"   // answer 503 at once
	Fault500  FaultKind = "500"   // answer 500 at once
	Fault429  FaultKind = "429"   // answer 429 at once, as a rate limiter in front of an engine does
	FaultHang FaultKind = "hang"  // accept, never answer
	FaultDrop FaultKind = "drop"  // close the connection mid-response
	FaultNoKV FaultKind = "no-kv" // a prefill answers 200 without kv_transfer_params
	FaultSlow FaultKind = "slow"  // the first byte comes Delay late
	// FaultLate is a non-streamed answer that comes Delay late, after the
	// work: a prefill's KV is held by then, and stays held for its lease
	// if the client leaves before the answer, as vLLM's would.
	FaultLate FaultKind = "late"
)

var faultKinds = []FaultKind{Fault503, Fault500, Fault429, FaultHang, FaultDrop, FaultNoKV, FaultSlow, FaultLate}

// Fault injects failures into a share of the generation requests.
type Fault struct {
	// Rate is the probability, 0 to 1, that a request gets the fault.
	Rate float64   `json:"rate"`
	Kind FaultKind `json:"kind"`
	// Delay is how late the first byte comes with FaultSlow, and the
	// answer with FaultLate.
	Delay Duration `json:"delay"`
}

// Validate checks the rate and kind.
func (f Fault) Validate() error {
	if f.Rate < 0 || f.Rate > 1 {
		return fmt.Errorf("fault rate %v is not between 0 and 1", f.Rate)
	}
	if f.Rate > 0 && !knownFault(f.Kind) {
		return fmt.Errorf("unknown fault kind %q (want one of %s)", f.Kind, faultKindList())
	}
	if f.Delay < 0 {
		return errors.New("fault delay must not be negative")
	}
	return nil
}

func knownFault(k FaultKind) bool {
	for _, f := range faultKinds {
		if k == f {
			return true
		}
	}
	return false
}

func faultKindList() string {
	s := make([]string, len(faultKinds))
	for i, k := range faultKinds {
		s[i] = string(k)
	}
	return strings.Join(s, ", ")
}

// FaultInjector draws the fault of each request of an engine. It lives
// beside Fault, whose Rate and Kind it applies; the engine changes it at
// run time (POST /sim/faults).
type FaultInjector struct {
	// mu guards fault and rng.
	mu    sync.Mutex
	fault Fault
	rng   *mrand.Rand
}

// NewFaultInjector draws f, at random from seed.
func NewFaultInjector(f Fault, seed uint64) *FaultInjector {
	return &FaultInjector{fault: f, rng: mrand.New(mrand.NewPCG(seed, 0x5eed))}
}

// Set changes the fault.
func (f *FaultInjector) Set(v Fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fault = v
}

// Get is the fault.
func (f *FaultInjector) Get() Fault {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fault
}

// Draw picks the fault of one request: Kind with probability Rate.
func (f *FaultInjector) Draw() (FaultKind, time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fault.Rate <= 0 || (f.fault.Rate < 1 && f.rng.Float64() >= f.fault.Rate) {
		return FaultNone, 0
	}
	return f.fault.Kind, time.Duration(f.fault.Delay)
}
