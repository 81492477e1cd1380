package sched

import (
	"container/heap"
	"time"
)

// Arrival is one request of a virtual benchmark run.
type Arrival struct {
	// At is when it is sent, from the start of the run.
	At           time.Duration
	PromptTokens int
	Hashes       []uint64
	OutputTokens int
	Priority     int
}

// Outcome is what a client measured of one request.
type Outcome struct {
	TTFT, E2E time.Duration
	Output    int
	// Cached is the prompt tokens the decode leg did not compute.
	Cached int
}

// TPOT is vLLM bench's time per output token after the first.
func (o Outcome) TPOT() time.Duration {
	if o.Output <= 1 {
		return 0
	}
	return (o.E2E - o.TTFT) / time.Duration(o.Output-1)
}

// PD is a virtual P/D pair: one prefill engine, one decode engine, a
// router between them, in virtual time.
type PD struct {
	Prefill, Decode Config
	// TransferPerBlock is the time to read one KV block from the prefill
	// engine; TransferBase the fixed cost of a read (handshake, notify).
	TransferPerBlock, TransferBase time.Duration
	// Hop is the router's cost on each leg: receive, dispatch, relay.
	Hop time.Duration
	// Recompute sends the decode leg without kv_transfer_params, as a
	// router that drops them does: the decode engine prefills the prompt
	// again, and the prefill engine's blocks are freed at once (as if
	// released; holding them to the lease would only make it worse).
	Recompute bool
}

// Run sends the arrivals through the pair and returns their outcomes, in
// the arrivals' order. It runs in virtual time: its figures are the
// model's, whatever the machine.
func (pd PD) Run(arrivals []Arrival) ([]Outcome, error) {
	pre, err := New(pd.Prefill)
	if err != nil {
		return nil, err
	}
	dec, err := New(pd.Decode)
	if err != nil {
		return nil, err
	}
	out := make([]Outcome, len(arrivals))
	type leg struct {
		i       int
		prefill *Request
		first   time.Duration
	}
	legs := map[*Request]*leg{} // by either leg's request
	var runErr error
	var q events
	var now time.Duration
	engines := []*virtualEngine{{s: pre}, {s: dec}}
	for i, a := range arrivals {
		q.push(a.At+pd.Hop, func() {
			r := &Request{ID: "p", Kind: Prefill, PromptTokens: a.PromptTokens, Hashes: a.Hashes, MaxTokens: 1, Priority: a.Priority}
			legs[r] = &leg{i: i}
			if err := pre.Add(r); err != nil {
				runErr = err
			}
		})
	}
	onEvent := map[*Scheduler]func(Event){
		pre: func(e Event) {
			if !e.Done {
				return
			}
			l := legs[e.Req]
			delete(legs, e.Req)
			a := arrivals[l.i]
			kind := Decode
			if pd.Recompute {
				kind = Local
				pre.Release(e.Req)
			}
			d := &Request{ID: "d", Kind: kind, PromptTokens: a.PromptTokens, Hashes: a.Hashes, MaxTokens: a.OutputTokens, Priority: a.Priority}
			l.prefill = e.Req
			q.push(now+pd.Hop, func() {
				legs[d] = l
				if err := dec.Add(d); err != nil {
					runErr = err
				}
			})
		},
		dec: func(e Event) {
			l := legs[e.Req]
			a := arrivals[l.i]
			if e.Req.Generated() == 1 {
				l.first = now
			}
			if e.Done {
				out[l.i] = Outcome{TTFT: l.first - a.At, E2E: now - a.At, Output: e.Req.Generated(), Cached: e.Req.CachedTokens()}
				delete(legs, e.Req)
			}
		},
	}
	for {
		for _, en := range engines {
			if en.plan != nil {
				continue
			}
			p := en.s.Schedule()
			for _, r := range p.Loads {
				l := legs[r]
				blocks := (r.ExternalTokens() + pd.Decode.BlockSize - 1) / pd.Decode.BlockSize
				q.push(now+pd.TransferBase+time.Duration(blocks)*pd.TransferPerBlock, func() {
					dec.Loaded(r, true)
					pre.Release(l.prefill)
				})
			}
			if !p.Empty() {
				en.plan = p
				q.push(now+p.Duration, func() {
					en.plan = nil
					for _, e := range en.s.Complete(p) {
						onEvent[en.s](e)
					}
				})
			}
		}
		if runErr != nil {
			return nil, runErr
		}
		if q.h.Len() == 0 {
			return out, nil
		}
		ev := q.pop()
		now = ev.at
		ev.do()
	}
}

type virtualEngine struct {
	s    *Scheduler
	plan *Plan
}

// events is a queue of things to do at virtual times, in time order, then
// in the order they were queued.
type events struct {
	h   eventHeap
	seq int
}

func (q *events) push(at time.Duration, do func()) {
	q.seq++
	heap.Push(&q.h, event{at: at, seq: q.seq, do: do})
}

func (q *events) pop() event { return heap.Pop(&q.h).(event) }

type event struct {
	at  time.Duration
	seq int
	do  func()
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	return h[i].at < h[j].at || h[i].at == h[j].at && h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
