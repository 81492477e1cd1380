package dispatcher

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// loopTest is one stage loop on its own pool, with a gateway-side reply
// listener.
type loopTest struct {
	t       *testing.T
	nc      *nats.Conn
	js      jetstream.JetStream
	pool    string
	replies *Replies
	cancel  context.CancelFunc
	done    chan struct{}
	loop    *StageLoop
}

func startLoop(t *testing.T, nc *nats.Conn, js jetstream.JetStream, cfg StageConfig) *loopTest {
	t.Helper()
	cfg.Pool = PoolName(t.Name())
	cfg.Stage = StagePrefill
	if cfg.Slots == 0 {
		cfg.Slots = 1
	}
	cfg.RetryBase = 10 * time.Millisecond
	cfg.Grace = 5 * time.Second
	loop, err := NewStageLoop(nc, js, cfg, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	replies, err := NewReplies(nc, "gw-"+cfg.Pool)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	lt := &loopTest{t: t, nc: nc, js: js, pool: cfg.Pool, replies: replies, cancel: cancel, done: make(chan struct{}), loop: loop}
	go func() {
		defer close(lt.done)
		if err := loop.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() {
		lt.stop()
		replies.Close()
	})
	return lt
}

func (lt *loopTest) stop() {
	lt.cancel()
	<-lt.done
}

// submit queues a job and opens its reply stream.
func (lt *loopTest) submit(id string) *ReplyStream {
	lt.t.Helper()
	s, err := lt.replies.Open(id)
	if err != nil {
		lt.t.Fatal(err)
	}
	lt.t.Cleanup(s.Close)
	job := &Job{ID: id, Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`), ReplyTo: lt.replies.Subject(id)}
	if err := NewSubmitter(lt.js).Submit(context.Background(), StagePrefill, job); err != nil {
		lt.t.Fatal(err)
	}
	return s
}

// pending counts the stage stream's messages of this pool.
func (lt *loopTest) pending(stage Stage) uint64 {
	lt.t.Helper()
	st, err := lt.js.Stream(context.Background(), stageStream(stage))
	if err != nil {
		lt.t.Fatal(err)
	}
	info, err := st.Info(context.Background(), jetstream.WithSubjectFilter(stageSubject(stage)+"."+lt.pool+".>"))
	if err != nil {
		lt.t.Fatal(err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n
}

func (lt *loopTest) deadLetter(id string) *jetstream.RawStreamMsg {
	lt.t.Helper()
	st, err := lt.js.Stream(context.Background(), StreamDLQ)
	if err != nil {
		lt.t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(context.Background(), DLQSubject(lt.pool, id))
	if err != nil {
		return nil
	}
	return m
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestStageLoop(t *testing.T) {
	nc, js := startJetStream(t)
	ctx := context.Background()

	t.Run("retried with back-off until it succeeds, then forwarded and acked", func(t *testing.T) {
		var attempts []int
		var mu sync.Mutex
		lt := startLoop(t, nc, js, StageConfig{Handler: func(ctx context.Context, d *Delivery) error {
			mu.Lock()
			attempts = append(attempts, d.Attempt)
			mu.Unlock()
			if d.Attempt < 3 {
				return Retryable(errors.New("engine down"), nil)
			}
			next := *d.Job
			next.KVTransferParams = []byte(`{"remote_block_ids":[[1]]}`)
			return d.Forward(ctx, StageDecode, &next)
		}})
		lt.submit("job-1")
		waitFor(t, "the handoff", func() bool { return lt.pending(StageDecode) == 1 })
		waitFor(t, "the ack", func() bool { return lt.pending(StagePrefill) == 0 })
		mu.Lock()
		defer mu.Unlock()
		if len(attempts) != 3 || attempts[2] != 3 {
			t.Errorf("attempts = %v, want [1 2 3]", attempts)
		}
		st, _ := js.Stream(ctx, StreamDecode)
		m, err := st.GetLastMsgForSubject(ctx, JobSubject(StageDecode, lt.pool, "job-1"))
		if err != nil || !strings.Contains(string(m.Data), `"kv_transfer_params":{"remote_block_ids":[[1]]}`) || m.Header.Get(jetstream.MsgIDHeader) != "job-1/decode" {
			t.Errorf("handoff %s %v: %v", m.Data, m.Header, err)
		}
	})

	t.Run("a permanent failure reaches the client once and is dead-lettered", func(t *testing.T) {
		var calls atomic.Int32
		lt := startLoop(t, nc, js, StageConfig{Handler: func(context.Context, *Delivery) error {
			calls.Add(1)
			return Permanent(errors.New("engine said 400"), openai.NewError(400, "prompt too long"))
		}})
		s := lt.submit("job-2")
		r, err := s.Next(ctx, 10*time.Second)
		if err != nil || r.Kind != KindError || r.Status != 400 || !strings.Contains(string(r.Data), "prompt too long") {
			t.Fatalf("reply %+v %s, %v", r, r.Data, err)
		}
		waitFor(t, "the dead letter", func() bool { return lt.deadLetter("job-2") != nil })
		if dl := lt.deadLetter("job-2"); dl.Header.Get(HeaderStage) != "prefill" || !strings.Contains(dl.Header.Get(HeaderReason), "400") {
			t.Errorf("dead letter headers %v", dl.Header)
		}
		time.Sleep(200 * time.Millisecond) // many retry delays
		if calls.Load() != 1 || lt.pending(StagePrefill) != 0 {
			t.Errorf("handler ran %d times, %d jobs left; want 1 run and none", calls.Load(), lt.pending(StagePrefill))
		}
	})

	t.Run("out of attempts after MaxDeliver", func(t *testing.T) {
		var calls atomic.Int32
		lt := startLoop(t, nc, js, StageConfig{Handler: func(context.Context, *Delivery) error {
			calls.Add(1)
			return errors.New("connection refused")
		}})
		s := lt.submit("job-3")
		r, err := s.Next(ctx, 10*time.Second)
		if err != nil || r.Kind != KindError || r.Status != 502 || !strings.Contains(string(r.Data), "after 4 attempts") {
			t.Fatalf("reply %+v %s, %v", r, r.Data, err)
		}
		if calls.Load() != MaxDeliver {
			t.Errorf("handler ran %d times, want %d", calls.Load(), MaxDeliver)
		}
		waitFor(t, "the dead letter", func() bool { return lt.deadLetter("job-3") != nil })
	})

	t.Run("pulls only as many jobs as it has slots", func(t *testing.T) {
		release := make(chan struct{})
		var running, peak atomic.Int32
		lt := startLoop(t, nc, js, StageConfig{Slots: 2, Handler: func(ctx context.Context, d *Delivery) error {
			n := running.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			defer running.Add(-1)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
		for _, id := range []string{"a", "b", "c", "d", "e"} {
			lt.submit("job-4" + id)
		}
		waitFor(t, "two running", func() bool { return running.Load() == 2 })
		cons, err := js.Consumer(ctx, StreamPrefill, ConsumerName(StagePrefill, lt.pool))
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // room for a wrong prefetch to show
		info, err := cons.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.NumAckPending != 2 || info.NumPending != 3 {
			t.Errorf("ack pending %d, pending %d; want 2 delivered and 3 waiting in the stream", info.NumAckPending, info.NumPending)
		}
		close(release)
		waitFor(t, "all done", func() bool { return lt.pending(StagePrefill) == 0 })
		if peak.Load() != 2 {
			t.Errorf("peak concurrency %d, want 2", peak.Load())
		}
	})

	t.Run("a cancel stops the job without a retry", func(t *testing.T) {
		var calls atomic.Int32
		started := make(chan struct{}, 1)
		var cause atomic.Value
		lt := startLoop(t, nc, js, StageConfig{Handler: func(ctx context.Context, d *Delivery) error {
			calls.Add(1)
			started <- struct{}{}
			<-ctx.Done()
			cause.Store(context.Cause(ctx))
			return ctx.Err()
		}})
		lt.submit("job-5")
		<-started
		if err := nc.Publish(CancelSubject("job-5"), nil); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the job dropped", func() bool { return lt.pending(StagePrefill) == 0 })
		time.Sleep(100 * time.Millisecond)
		if calls.Load() != 1 || !errors.Is(cause.Load().(error), errCancelled) {
			t.Errorf("handler ran %d times, cause %v", calls.Load(), cause.Load())
		}
	})

	t.Run("shutdown lets a running job finish and ack", func(t *testing.T) {
		started := make(chan struct{})
		lt := startLoop(t, nc, js, StageConfig{Handler: func(ctx context.Context, d *Delivery) error {
			close(started)
			select {
			case <-time.After(200 * time.Millisecond):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
		lt.submit("job-6")
		<-started
		lt.stop()
		if n := lt.pending(StagePrefill); n != 0 {
			t.Errorf("%d jobs left after a graceful stop, want the running one acked", n)
		}
	})

	t.Run("a job longer than the ack wait is kept alive, not redelivered", func(t *testing.T) {
		var calls atomic.Int32
		lt := startLoop(t, nc, js, StageConfig{Slots: 2, AckWait: 300 * time.Millisecond, Handler: func(ctx context.Context, d *Delivery) error {
			calls.Add(1)
			select {
			case <-time.After(1500 * time.Millisecond): // five ack waits
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
		lt.submit("job-8")
		waitFor(t, "the ack", func() bool { return lt.pending(StagePrefill) == 0 })
		if calls.Load() != 1 {
			t.Errorf("handler ran %d times; InProgress should have kept the job with its first worker", calls.Load())
		}
	})

	t.Run("workers register and leave the registry", func(t *testing.T) {
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		reg, err := WatchWorkers(rctx, js, logging.Discard())
		if err != nil {
			t.Fatal(err)
		}
		lt := startLoop(t, nc, js, StageConfig{Slots: 3, Worker: WorkerInfo{ID: NewWorkerID(StagePrefill), Model: "model-7"},
			Handler: func(context.Context, *Delivery) error { return nil }})
		waitFor(t, "registration", func() bool { return reg.Status("model-7").Prefill == 1 })
		w := reg.Workers()
		if len(w) != 1 || w[0].Slots != 3 || w[0].Pool != lt.pool || w[0].Role != StagePrefill {
			t.Errorf("registry = %+v", w)
		}
		if len(reg.Models()) != 0 {
			t.Errorf("models %v listed without a decode worker", reg.Models())
		}
		lt.stop()
		waitFor(t, "deregistration", func() bool { return reg.Status("model-7").Prefill == 0 })
		if !reg.Status("model-7").Known {
			t.Error("a model seen before is no longer known")
		}
	})
}
