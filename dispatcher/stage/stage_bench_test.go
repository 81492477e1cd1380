package stage

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/pull"
	"github.com/pdq-dev/pdq/pkg/config"
)

// BenchmarkDurablePath is the part of a request's way through pdq that
// JetStream carries, with nothing else: no HTTP, no engines. A gateway
// stores the job (publish, acknowledged) and waits; a prefill worker,
// whose pull waits for it, takes it, stores the handoff and acks; a
// decode worker takes that and acks. With records, the gateway also
// creates the request's record before the job and writes its end after,
// and each worker reads it at admission, as pdq's stages do. It reports
// the CPU of the whole process (the embedded server's included) per
// request: what two durable hops cost at the least, beside the HTTP work
// a plain proxy does (tools/pdproxy, in make bench). At concurrency 1,
// ns/op is the time a request spends in the queues (with records, their
// creation and end too). Each stream holds a keeper, as in pdq: without
// one, each ack there empties its stream, and the file store replaces the
// stream's last block with a new file, about half of the CPU there in a
// profile.
func BenchmarkDurablePath(b *testing.B) {
	for _, records := range []bool{false, true} {
		for _, conc := range []int{1, 64} {
			name := fmt.Sprintf("hops/c=%d", conc)
			if records {
				name = fmt.Sprintf("hops+records/c=%d", conc)
			}
			b.Run(name, func(b *testing.B) { benchDurablePath(b, conc, records, 1500) })
		}
	}
	// A 400 KB prompt's body through the two hops: the bytes allocated
	// (the server's too), as a multiple of the body.
	b.Run("hops/400KB/c=1", func(b *testing.B) { benchDurablePath(b, 1, false, 400<<10) })
}

// benchDurablePath runs BenchmarkDurablePath's requests, conc at a time,
// with records or not, each job's body size bytes.
func benchDurablePath(b *testing.B, conc int, records bool, size int) {
	nc, js := dispatchertest.JetStream(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	recs, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		b.Fatal(err)
	}
	proto := dispatchertest.BenchJob(size)
	stages := map[dispatcher.Stage]jetstream.Consumer{}
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		if stages[stage], err = dispatcher.EnsureConsumer(ctx, js, stage, proto.Pool, config.DefaultAckWait); err != nil {
			b.Fatal(err)
		}
		// Each stream's keeper, as pdq's stage loops keep one (dispatcher/pull/keeper.go).
		if _, err := js.Publish(ctx, dispatcher.KeeperSubject(stage), []byte(dispatcher.KeeperNote)); err != nil {
			b.Fatal(err)
		}
	}
	var done sync.Map // id → chan struct{}, closed by the decode worker
	var workers sync.WaitGroup
	work := func(stage dispatcher.Stage) {
		defer workers.Done()
		p := pull.NewPuller(ctx, nc, js, config.PullWait)
		defer p.Stop()
		for {
			m, err := p.Next(ctx, stages[stage])
			if ctx.Err() != nil {
				return
			}
			if errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrNoMessages) {
				continue // an expired pull
			}
			if err != nil {
				b.Error(err)
				return
			}
			job, err := dispatcher.ParseJob(m.Headers(), m.Data())
			if err != nil {
				b.Error(err)
				return
			}
			if records {
				if _, _, err := recs.GetChanged(ctx, job.ID, job.RecordRevision); err != nil {
					b.Error(err)
				}
			}
			// The decode worker can take a handoff before its publish is
			// acknowledged here: the last request may end, and ctx with
			// it, while the publish of a stored handoff waits.
			if stage == dispatcher.StagePrefill {
				if err := dispatcher.Publish(ctx, js, job.Msg(dispatcher.StageDecode)); err != nil && ctx.Err() == nil {
					b.Error(err)
				}
			}
			if err := m.Ack(); err != nil {
				b.Error(err)
			}
			if stage == dispatcher.StageDecode {
				if ch, ok := done.LoadAndDelete(job.ID); ok {
					close(ch.(chan struct{}))
				}
			}
		}
	}
	for range conc {
		workers.Add(2)
		go work(dispatcher.StagePrefill)
		go work(dispatcher.StageDecode)
	}
	var n atomic.Int64
	request := func() error {
		job := *proto
		job.ID = "bench-" + strconv.FormatInt(n.Add(1), 10)
		rec := &dispatcher.Record{ID: job.ID, State: dispatcher.StateQueued, Generation: 1, Model: job.Model, Pool: job.Pool, Endpoint: job.Endpoint,
			Stream: true, Gateway: job.GatewayID(), Created: job.Submitted, Updated: job.Submitted, Deadline: job.Deadline}
		if records {
			rev, err := recs.Create(ctx, rec)
			if err != nil {
				return err
			}
			job.RecordRevision = rev
		}
		ch := make(chan struct{})
		done.Store(job.ID, ch)
		if err := dispatcher.Publish(ctx, js, job.Msg(dispatcher.StagePrefill)); err != nil {
			return err
		}
		select {
		case <-ch:
		case <-time.After(10 * time.Second): // a worker gave up on an error
			return fmt.Errorf("request %s: not decoded within 10 s", job.ID)
		}
		if records {
			rec.State = dispatcher.StateDone
			if _, err := recs.Update(ctx, rec, job.RecordRevision); err != nil {
				return err
			}
		}
		return nil
	}
	for range 2 * conc { // pulls waiting, streams' blocks open
		if err := request(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := processCPU(b)
	var mem0, mem1 runtime.MemStats
	runtime.ReadMemStats(&mem0)
	var gateways sync.WaitGroup
	var left atomic.Int64 // requests not yet sent, of b.N
	left.Store(int64(b.N))
	for range conc {
		gateways.Add(1)
		go func() {
			defer gateways.Done()
			for left.Add(-1) >= 0 {
				if err := request(); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	gateways.Wait()
	b.StopTimer()
	runtime.ReadMemStats(&mem1)
	b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/req")
	if size >= 64<<10 {
		b.ReportMetric(float64(mem1.TotalAlloc-mem0.TotalAlloc)/float64(b.N)/float64(size), "alloc-bodies/req")
	}
	cancel()
	workers.Wait()
}

// processCPU is the process's user and system CPU time so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
