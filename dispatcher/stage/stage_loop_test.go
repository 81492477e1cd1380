package stage

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/admin"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/registry"
	"github.com/pdq-dev/pdq/dispatcher/reply"
	"github.com/pdq-dev/pdq/dispatcher/submit"
	"github.com/pdq-dev/pdq/dispatcher/verdict"
	"github.com/pdq-dev/pdq/pkg/config"
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
	stage   dispatcher.Stage // the loop's; "" (as prefill) for a loop the test runs by hand
	replies *reply.Replies
	cancel  context.CancelFunc
	done    chan struct{}
	loop    *Loop
}

func startLoop(t *testing.T, nc *nats.Conn, js jetstream.JetStream, cfg Config) *loopTest {
	t.Helper()
	return startLoopOn(t, nc, js, dispatcher.PoolName(t.Name()), cfg)
}

// startLoopOn starts a loop on pool.
func startLoopOn(t *testing.T, nc *nats.Conn, js jetstream.JetStream, pool string, cfg Config) *loopTest {
	t.Helper()
	cfg.Pool = pool
	if cfg.Stage == "" {
		cfg.Stage = dispatcher.StagePrefill
	}
	if cfg.Slots == 0 {
		cfg.Slots = 1
	}
	cfg.RetryBase = 10 * time.Millisecond
	cfg.Grace = 5 * time.Second
	if cfg.PullWait == 0 {
		cfg.PullWait = 100 * time.Millisecond // each stop waits for it
	}
	loop, err := NewLoop(nc, js, withSettings(cfg), logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	replies, err := reply.NewReplies(nc, "gw-"+cfg.Pool)
	if err != nil {
		t.Fatal(err)
	}
	pings, err := registry.AnswerPings(nc, "gw-"+cfg.Pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pings.Unsubscribe() })
	ctx, cancel := context.WithCancel(context.Background())
	lt := &loopTest{t: t, nc: nc, js: js, pool: cfg.Pool, stage: cfg.Stage, replies: replies, cancel: cancel, done: make(chan struct{}), loop: loop}
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
func (lt *loopTest) submit(id string) *reply.Stream {
	lt.t.Helper()
	s, err := lt.replies.Open(id)
	if err != nil {
		lt.t.Fatal(err)
	}
	lt.t.Cleanup(s.Close)
	lt.submitJob(&dispatcher.Job{ID: id, Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`), ReplyTo: lt.replies.Subject(id),
		Deadline: time.Now().Add(time.Minute)})
	return s
}

// submitJob queues job, as the gateway does.
func (lt *loopTest) submitJob(job *dispatcher.Job) {
	lt.t.Helper()
	records, err := dispatcher.OpenRecords(context.Background(), lt.js)
	if err != nil {
		lt.t.Fatal(err)
	}
	stage := lt.stage
	if stage == "" {
		stage = dispatcher.StagePrefill
	}
	if _, err := submit.NewSubmitter(lt.js, records, registry.NewLiveness(lt.nc)).Submit(context.Background(), stage, job); err != nil {
		lt.t.Fatal(err)
	}
}

// record reads a request's record.
func (lt *loopTest) record(id string) *dispatcher.Record {
	lt.t.Helper()
	records, err := dispatcher.OpenRecords(context.Background(), lt.js)
	if err != nil {
		lt.t.Fatal(err)
	}
	r, _, err := records.Get(context.Background(), id)
	if err != nil {
		lt.t.Fatal(err)
	}
	return r
}

// pending counts the stage stream's messages of this pool.
func (lt *loopTest) pending(stage dispatcher.Stage) uint64 {
	lt.t.Helper()
	st, err := lt.js.Stream(context.Background(), dispatcher.StageStream(stage))
	if err != nil {
		lt.t.Fatal(err)
	}
	info, err := st.Info(context.Background(), jetstream.WithSubjectFilter(dispatcher.StageSubject(stage)+"."+lt.pool+".>"))
	if err != nil {
		lt.t.Fatal(err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n
}

// handoff reads id's last message on the decode stage, and the job it
// holds.
func (lt *loopTest) handoff(id string) (*jetstream.RawStreamMsg, *dispatcher.Job) {
	lt.t.Helper()
	st, err := lt.js.Stream(context.Background(), dispatcher.StreamDecode)
	if err != nil {
		lt.t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(context.Background(), dispatcher.JobSubject(dispatcher.StageDecode, lt.pool, id))
	if err != nil {
		lt.t.Fatal(err)
	}
	job, err := dispatcher.ParseJob(m.Header, m.Data)
	if err != nil {
		lt.t.Fatalf("the decode job of %s: %v", id, err)
	}
	return m, job
}

func (lt *loopTest) deadLetter(id string) *jetstream.RawStreamMsg {
	lt.t.Helper()
	st, err := lt.js.Stream(context.Background(), dispatcher.StreamDLQ)
	if err != nil {
		lt.t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(context.Background(), dispatcher.DLQSubject(lt.pool, id))
	if err != nil {
		return nil
	}
	return m
}

// recv receives from ch, failing the test after 10 s: a regression
// fails, rather than hangs until the package's time-out.

func TestStageLoop(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()

	t.Run("retried with back-off until it succeeds, then forwarded and acked", func(t *testing.T) {
		var attempts []int
		var mu sync.Mutex
		lt := startLoop(t, nc, js, Config{Handler: func(ctx context.Context, d *Delivery) error {
			mu.Lock()
			attempts = append(attempts, d.Attempt)
			mu.Unlock()
			if d.Attempt < 3 {
				return verdict.Retryable(errors.New("engine down"), nil)
			}
			d.HandOff([]byte(`{"remote_block_ids":[[1]]}`), dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
			return nil
		}})
		lt.submit("job-1")
		dispatchertest.WaitFor(t, "the handoff", func() bool { return lt.pending(dispatcher.StageDecode) == 1 })
		dispatchertest.WaitFor(t, "the ack", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		mu.Lock()
		defer mu.Unlock()
		if len(attempts) != 3 || attempts[2] != 3 {
			t.Errorf("attempts = %v, want [1 2 3]", attempts)
		}
		m, h := lt.handoff("job-1")
		if string(h.Body) != `{}` || string(h.KV) != `{"remote_block_ids":[[1]]}` ||
			m.Header.Get(jetstream.MsgIDHeader) != "job-1/d1" || m.Header.Get(dispatcher.HeaderGeneration) != "1" {
			t.Errorf("handoff %s %v", m.Data, m.Header)
		}
	})

	t.Run("a client's error reaches the client once and is recorded, not dead-lettered", func(t *testing.T) {
		var calls atomic.Int32
		lt := startLoop(t, nc, js, Config{Handler: func(context.Context, *Delivery) error {
			calls.Add(1)
			return verdict.Permanent(errors.New("engine said 400"), openai.NewError(400, "prompt too long"))
		}})
		s := lt.submit("job-2")
		r, err := s.Next(ctx, 10*time.Second)
		if err != nil || r.Kind != dispatcher.KindError || r.Status != 400 || !strings.Contains(string(r.Data), "prompt too long") {
			t.Fatalf("reply %+v %s, %v", r, r.Data, err)
		}
		dispatchertest.WaitFor(t, "the job gone", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		time.Sleep(200 * time.Millisecond) // many retry delays
		if calls.Load() != 1 || lt.pending(dispatcher.StagePrefill) != 0 {
			t.Errorf("handler ran %d times, %d jobs left; want 1 run and none", calls.Load(), lt.pending(dispatcher.StagePrefill))
		}
		if lt.deadLetter("job-2") != nil {
			t.Error("a client's own error was dead-lettered")
		}
		if r := lt.record("job-2"); r.State != dispatcher.StateFailed || r.Error == nil || r.Error.Status != 400 {
			t.Errorf("record %+v, want failed with 400", r)
		}
	})

	t.Run("out of attempts after config.DefaultMaxDeliver", func(t *testing.T) {
		var calls atomic.Int32
		lt := startLoop(t, nc, js, Config{Handler: func(context.Context, *Delivery) error {
			calls.Add(1)
			return errors.New("connection refused")
		}})
		s := lt.submit("job-3")
		r, err := s.Next(ctx, 10*time.Second)
		if err != nil || r.Kind != dispatcher.KindError || r.Status != 502 || !strings.Contains(string(r.Data), "after 4 attempts") {
			t.Fatalf("reply %+v %s, %v", r, r.Data, err)
		}
		if calls.Load() != config.DefaultMaxDeliver {
			t.Errorf("handler ran %d times, want %d", calls.Load(), config.DefaultMaxDeliver)
		}
		dispatchertest.WaitFor(t, "the dead letter", func() bool { return lt.deadLetter("job-3") != nil })
		if dl := lt.deadLetter("job-3"); dl.Header.Get(dispatcher.HeaderStage) != "prefill" || dl.Header.Get(dispatcher.HeaderStatus) != "502" ||
			!strings.Contains(dl.Header.Get(dispatcher.HeaderReason), "connection refused") || string(dl.Data) != `{}` {
			t.Errorf("dead letter %v %s", dl.Header, dl.Data)
		}
		if r := lt.record("job-3"); r.State != dispatcher.StateFailed || r.Error.Status != 502 {
			t.Errorf("record %+v, want failed with 502", r)
		}
	})

	t.Run("pulls only as many jobs as it has slots", func(t *testing.T) {
		release := make(chan struct{})
		var running, peak atomic.Int32
		lt := startLoop(t, nc, js, Config{Slots: 2, Handler: func(ctx context.Context, d *Delivery) error {
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
		dispatchertest.WaitFor(t, "two running", func() bool { return running.Load() == 2 })
		cons, err := js.Consumer(ctx, dispatcher.StreamPrefill, dispatcher.ConsumerName(dispatcher.StagePrefill, lt.pool))
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
		dispatchertest.WaitFor(t, "all done", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		if peak.Load() != 2 {
			t.Errorf("peak concurrency %d, want 2", peak.Load())
		}
	})

	t.Run("a cancel stops the job without a retry", func(t *testing.T) {
		var calls atomic.Int32
		started := make(chan struct{}, 1)
		var cause atomic.Value
		lt := startLoop(t, nc, js, Config{Handler: func(ctx context.Context, d *Delivery) error {
			calls.Add(1)
			started <- struct{}{}
			<-ctx.Done()
			cause.Store(context.Cause(ctx))
			return ctx.Err()
		}})
		lt.submit("job-5")
		dispatchertest.Recv(t, "the handler started", started)
		if err := nc.Publish(dispatcher.CancelSubject("job-5"), nil); err != nil {
			t.Fatal(err)
		}
		dispatchertest.WaitFor(t, "the job dropped", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		time.Sleep(100 * time.Millisecond)
		if calls.Load() != 1 || !errors.Is(cause.Load().(error), errCancelled) {
			t.Errorf("handler ran %d times, cause %v", calls.Load(), cause.Load())
		}
	})

	t.Run("a cancel stops its request, not a retry of the id", func(t *testing.T) {
		started := make(chan struct{}, 1)
		stopped := make(chan error, 1)
		lt := startLoop(t, nc, js, Config{Handler: func(ctx context.Context, d *Delivery) error {
			started <- struct{}{}
			<-ctx.Done()
			stopped <- context.Cause(ctx)
			return ctx.Err()
		}})
		// cancelStops cancels the request id claimed at origin, and wants
		// the running job stopped by it.
		cancelStops := func(id string, origin int, what string) {
			t.Helper()
			if err := submit.Cancel(nc, id, origin); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-stopped:
				if !errors.Is(err, errCancelled) {
					t.Errorf("stopped by %v, want the cancel", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("a cancel of %s did not stop the job", what)
			}
		}
		lt.submit("job-gen") // claimed at generation 1
		dispatchertest.Recv(t, "the handler started", started)
		// A late cancel of another request under the same id (one claimed
		// at generation 2, from the worker's point of view a retry that
		// runs later, or an earlier one): not this request's business.
		if err := submit.Cancel(nc, "job-gen", 2); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-stopped:
			t.Fatalf("the request claimed at generation 1 stopped by another's cancel: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		cancelStops("job-gen", 1, "its own request")

		// A later generation of the request (prefilled again, or moved)
		// is the same request: its cancel stops it.
		job := &dispatcher.Job{ID: "job-gen2", Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`),
			ReplyTo: lt.replies.Subject("job-gen2"), Deadline: time.Now().Add(time.Minute), Generation: 2, Origin: 1}
		if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StagePrefill)); err != nil {
			t.Fatal(err)
		}
		dispatchertest.Recv(t, "the handler started", started)
		cancelStops("job-gen2", 1, "its request (a second generation of it)")
	})

	t.Run("a decode told a later attempt runs stops, and leaves the request to it", func(t *testing.T) {
		// A worker cut off from NATS past the ack wait: its job was
		// delivered again and runs elsewhere, and the gateway follows that
		// attempt. The first must stop, but neither record the request's
		// end nor end the message: both are the later attempt's.
		stopped := make(chan error, 1)
		running := make(chan struct{})
		lt := startLoop(t, nc, js, Config{Stage: dispatcher.StageDecode, StallTimeout: time.Second, Handler: func(ctx context.Context, d *Delivery) error {
			d.Replies() // its beats start; no output yet (a restart after output fails the request)
			close(running)
			<-ctx.Done()
			stopped <- context.Cause(ctx)
			return ctx.Err()
		}})
		s := lt.submit("job-superseded")
		chunks := make(chan string, 4)
		go func() {
			for {
				r, err := s.Next(ctx, 10*time.Second)
				if err != nil {
					return
				}
				chunks <- string(r.Data)
			}
		}()
		dispatchertest.Recv(t, "the handler running", running)
		// The later attempt's chunk: the stream follows it.
		later := reply.NewWriter(nc, lt.replies.Subject("job-superseded"), dispatcher.ReplyAttempt(1, 2))
		later.Chunk([]byte("again"))
		if c := dispatchertest.Recv(t, "the later attempt's chunk", chunks); c != "again" {
			t.Fatalf("chunk %q, want the later attempt's", c)
		}
		select {
		case err := <-stopped:
			if !errors.Is(err, reply.ErrSuperseded) {
				t.Fatalf("stopped by %v, want errSuperseded", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the superseded attempt still runs")
		}
		dispatchertest.WaitFor(t, "its settle", func() bool {
			lt.loop.mu.Lock()
			defer lt.loop.mu.Unlock()
			return len(lt.loop.running) == 0
		})
		if r := lt.record("job-superseded"); r.State != dispatcher.StateQueued {
			t.Errorf("record %+v: the superseded attempt ended the live request", r)
		}
		if n := lt.pending(dispatcher.StageDecode); n != 1 {
			t.Errorf("%d jobs left: the superseded attempt ended the message the later attempt holds", n)
		}
	})

	t.Run("a handler's panic ends its job, not the worker", func(t *testing.T) {
		var ran atomic.Int32
		lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
			ran.Add(1)
			if d.Job.ID == "job-poison" {
				panic("a bug that only this job's body reaches")
			}
			return nil
		}})
		s := lt.submit("job-poison")
		r, err := s.Next(ctx, 10*time.Second)
		if err != nil || r.Kind != dispatcher.KindError || r.Status != 500 {
			t.Fatalf("reply %+v %s, %v; want a 500", r, r.Data, err)
		}
		dispatchertest.WaitFor(t, "the dead letter", func() bool { return lt.deadLetter("job-poison") != nil })
		if rec := lt.record("job-poison"); rec.State != dispatcher.StateFailed {
			t.Errorf("record %+v, want failed", rec)
		}
		lt.submit("job-after-poison")
		dispatchertest.WaitFor(t, "the next job run", func() bool { return ran.Load() == 2 && lt.pending(dispatcher.StagePrefill) == 0 })
	})

	t.Run("a running job stops at its deadline, with no client to cancel it", func(t *testing.T) {
		var calls atomic.Int32
		var stopped atomic.Value
		lt := startLoop(t, nc, js, Config{Handler: func(ctx context.Context, d *Delivery) error {
			calls.Add(1)
			<-ctx.Done() // an engine call that would go on for ever
			stopped.Store(time.Now())
			return ctx.Err()
		}})
		// A replay's job: no reply subject, so no gateway gives up on it.
		// Long enough to be pulled and run on a loaded machine first.
		deadline := time.UnixMilli(time.Now().Add(2 * time.Second).UnixMilli()) // as the job carries it
		lt.submitJob(&dispatcher.Job{ID: "job-deadline", Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`), Deadline: deadline})
		dispatchertest.WaitFor(t, "the job dropped", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		at, _ := stopped.Load().(time.Time)
		if calls.Load() != 1 || at.Before(deadline) || at.After(deadline.Add(5*time.Second)) {
			t.Errorf("handler ran %d times, stopped at %v for a deadline at %v", calls.Load(), at, deadline)
		}
		if r := lt.record("job-deadline"); r.State != dispatcher.StateExpired || r.Error == nil || r.Error.Status != 504 {
			t.Errorf("record %+v, want expired with 504", r)
		}
	})

	t.Run("shutdown lets a running job finish and ack", func(t *testing.T) {
		started := make(chan struct{})
		lt := startLoop(t, nc, js, Config{Handler: func(ctx context.Context, d *Delivery) error {
			close(started)
			select {
			case <-time.After(200 * time.Millisecond):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
		lt.submit("job-6")
		dispatchertest.Recv(t, "the handler started", started)
		lt.stop()
		// The ack is a plain one, sent as the loop stops: the server takes
		// it a moment later. A job not acked stays (its ack wait is 30 s).
		dispatchertest.WaitFor(t, "the running job acked after a graceful stop", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
	})

	t.Run("a job longer than the ack wait is kept alive, not redelivered", func(t *testing.T) {
		var calls atomic.Int32
		lt := startLoop(t, nc, js, Config{Slots: 2, AckWait: 300 * time.Millisecond, Handler: func(ctx context.Context, d *Delivery) error {
			calls.Add(1)
			select {
			case <-time.After(1500 * time.Millisecond): // five ack waits
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
		lt.submit("job-8")
		dispatchertest.WaitFor(t, "the ack", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		if calls.Load() != 1 {
			t.Errorf("handler ran %d times; InProgress should have kept the job with its first worker", calls.Load())
		}
	})

	t.Run("workers register and leave the registry", func(t *testing.T) {
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		reg, err := registry.WatchWorkers(rctx, js, logging.Discard())
		if err != nil {
			t.Fatal(err)
		}
		lt := startLoop(t, nc, js, Config{Slots: 3, Worker: dispatcher.WorkerInfo{ID: dispatcher.NewWorkerID(dispatcher.StagePrefill), Model: "model-7"},
			Handler: func(context.Context, *Delivery) error { return nil }})
		dispatchertest.WaitFor(t, "registration", func() bool { return reg.Status("model-7").Prefill == 1 })
		w := reg.Workers()
		if len(w) != 1 || w[0].Slots != 3 || w[0].Pool != lt.pool || w[0].Role != dispatcher.StagePrefill {
			t.Errorf("registry = %+v", w)
		}
		if len(reg.Cards()) != 0 {
			t.Errorf("models %v listed without a decode worker", reg.Cards())
		}
		lt.stop()
		dispatchertest.WaitFor(t, "deregistration", func() bool { return reg.Status("model-7").Prefill == 0 })
		if !reg.Status("model-7").Known {
			t.Error("a model seen before is no longer known")
		}
	})
}

// TestLifecycle covers the ways a job used to end with no answer, or with
// work done twice.
func TestLifecycle(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()

	t.Run("deliveries used up by crashed workers end in an answer and a dead letter", func(t *testing.T) {
		var calls atomic.Int32
		pool := dispatcher.PoolName(t.Name())
		cons, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, 200*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		lt := &loopTest{t: t, nc: nc, js: js, pool: pool}
		lt.replies, err = reply.NewReplies(nc, "gw-"+pool)
		if err != nil {
			t.Fatal(err)
		}
		defer lt.replies.Close()
		s := lt.submit("crash-1")
		for i := range config.DefaultMaxDeliver {
			// A worker that pulls the job and dies: no ack, no nak.
			msg, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
			if err != nil {
				t.Fatalf("delivery %d: %v", i+1, err)
			}
			if meta, _ := msg.Metadata(); meta.NumDelivered != uint64(i+1) {
				t.Fatalf("delivery %d has NumDelivered %d", i+1, meta.NumDelivered)
			}
		}
		lt2 := startLoopOn(t, nc, js, lt.pool, Config{AckWait: 200 * time.Millisecond, Handler: func(context.Context, *Delivery) error {
			calls.Add(1)
			return nil
		}})
		r, err := s.Next(ctx, 10*time.Second)
		if err != nil || r.Kind != dispatcher.KindError || r.Status != 502 || !strings.Contains(string(r.Data), "4 deliveries") {
			t.Fatalf("reply %+v %s, %v; want a 502 after 4 deliveries", r, r.Data, err)
		}
		dispatchertest.WaitFor(t, "the dead letter", func() bool { return lt2.deadLetter("crash-1") != nil })
		dispatchertest.WaitFor(t, "the job gone", func() bool { return lt2.pending(dispatcher.StagePrefill) == 0 })
		if calls.Load() != 0 {
			t.Errorf("the handler ran %d times for a job out of deliveries", calls.Load())
		}
		if r := lt2.record("crash-1"); r.State != dispatcher.StateFailed {
			t.Errorf("record state %s, want failed", r.State)
		}
	})

	for _, tc := range []struct {
		name, id string
		spoil    func(*nats.Msg)
		status   int
		want     string
	}{
		// Both are answered at their reply subject and dead-lettered.
		{"a job of an unknown envelope version", "v9-1",
			func(m *nats.Msg) { m.Header.Set(dispatcher.HeaderVersion, "9") }, 500, "envelope version"},
		{"a job that fails validation", "bad-1",
			func(m *nats.Msg) { m.Header.Set(dispatcher.HeaderEndpoint, "embeddings") }, 500, "unknown endpoint"},
	} {
		t.Run(tc.name+" is answered and dead-lettered", func(t *testing.T) {
			lt := startLoop(t, nc, js, Config{Handler: func(context.Context, *Delivery) error {
				t.Error("the handler ran an unreadable job")
				return nil
			}})
			s, err := lt.replies.Open(tc.id)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			s.Start(2) // as the gateway waits for it: a reply of an earlier generation is dropped
			job := &dispatcher.Job{ID: tc.id, Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`),
				ReplyTo: lt.replies.Subject(tc.id), Generation: 2}
			m := job.Msg(dispatcher.StagePrefill)
			tc.spoil(m)
			if _, err := js.PublishMsg(ctx, m); err != nil {
				t.Fatal(err)
			}
			r, err := s.Next(ctx, 10*time.Second)
			if err != nil || r.Kind != dispatcher.KindError || r.Status != tc.status || !strings.Contains(string(r.Data), tc.want) {
				t.Fatalf("reply %+v %s, %v", r, r.Data, err)
			}
			dispatchertest.WaitFor(t, "the dead letter", func() bool { return lt.deadLetter(tc.id) != nil })
			dispatchertest.WaitFor(t, "the job gone", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		})
	}

	t.Run("the body travels as the client's bytes", func(t *testing.T) {
		body := []byte(`{"model":"m","prompt":"<a href=\"x\">&amp;</a>\u2028 é","z":1,  "a":[ 1 ]}`)
		got := make(chan []byte, 1)
		lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
			got <- d.Job.Body
			return nil
		}})
		records, _ := dispatcher.OpenRecords(ctx, js)
		job := &dispatcher.Job{ID: "raw-1", Model: "m", Pool: lt.pool, Endpoint: openai.Completions, Body: body,
			ReplyTo: lt.replies.Subject("raw-1"), Deadline: time.Now().Add(time.Minute)}
		if _, err := submit.NewSubmitter(js, records, registry.NewLiveness(nc)).Submit(ctx, dispatcher.StagePrefill, job); err != nil {
			t.Fatal(err)
		}
		select {
		case b := <-got:
			if string(b) != string(body) {
				t.Errorf("the worker got %s, want the client's bytes %s", b, body)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the job never ran")
		}
	})

	t.Run("a handoff whose kv_transfer_params outgrow a NATS header is stored whole", func(t *testing.T) {
		// ~16k block ids: the params of a 256k-token prompt, past the 64 KiB
		// a NATS header may hold.
		var kv strings.Builder
		kv.WriteString(`{"remote_engine_id":"e","remote_block_ids":[`)
		for i := range 16 << 10 {
			if i > 0 {
				kv.WriteByte(',')
			}
			fmt.Fprint(&kv, 100000+i)
		}
		kv.WriteString(`],"remote_host":"h","remote_port":1}`)
		lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
			d.HandOff([]byte(kv.String()), dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
			return nil
		}})
		lt.submit("big-kv-1")
		dispatchertest.WaitFor(t, "the handoff", func() bool { return lt.pending(dispatcher.StageDecode) == 1 })
		m, job := lt.handoff("big-kv-1")
		if string(job.KV) != kv.String() || string(job.Body) != `{}` {
			t.Fatalf("handoff read back with %d bytes of params and body %.40s", len(job.KV), job.Body)
		}
		hdr := 0
		for k, vs := range m.Header {
			for _, v := range vs {
				hdr += len(k) + len(v)
			}
		}
		if hdr > 4<<10 {
			t.Errorf("the handoff's headers hold %d bytes: what grows with the prompt belongs in the payload", hdr)
		}
	})

	t.Run("a handoff too large for a NATS message goes decode-only", func(t *testing.T) {
		// The largest body the gateway takes, and params of ~300k blocks: a
		// prompt of millions of tokens, past any message.
		body := []byte(`{"model":"m","prompt":"` + strings.Repeat("x", 7<<20-40) + `"}`)
		kv := []byte(`{"remote_block_ids":[` + strings.Repeat("1234567,", 300<<10) + `1]}`)
		lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
			d.HandOff(kv, dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
			return nil
		}})
		s, err := lt.replies.Open("huge-1")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		// It prefers a decode engine whose worker is gone: decode-only, it
		// goes to the pool's queue all the same (a reviewer's finding: the
		// forwarded copy took the preference back).
		lt.submitJob(&dispatcher.Job{ID: "huge-1", Model: "m", Pool: lt.pool, Endpoint: openai.Completions, Body: body,
			ReplyTo: lt.replies.Subject("huge-1"), Deadline: time.Now().Add(time.Minute), PreferDecode: dispatcher.EngineKey("http://gone")})
		dispatchertest.WaitFor(t, "the decode job", func() bool { return lt.pending(dispatcher.StageDecode) == 1 })
		dispatchertest.WaitFor(t, "the prefill acked", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		_, got := lt.handoff("huge-1")
		if len(got.KV) != 0 || got.Prefill != nil || len(got.Body) != len(body) {
			t.Errorf("decode job with %d bytes of params, prefill %v, %d bytes of body; want the body alone, decode-only",
				len(got.KV), got.Prefill, len(got.Body))
		}
		if r := lt.record("huge-1"); r.State.Ended() {
			t.Errorf("record %+v: the request ended instead of going decode-only", r)
		}
	})

	t.Run("a handoff the decode stream refuses is retried as a publish, not a prefill", func(t *testing.T) {
		nc, js := dispatchertest.JetStream(t) // its own server: the decode stream is made full
		st := limitStream(t, js, dispatcher.StreamDecode, 1)
		filler, err := js.Publish(ctx, dispatcher.JobSubject(dispatcher.StageDecode, "other", "filler"), []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
			calls.Add(1)
			d.HandOff([]byte(`{"remote_block_ids":[1]}`), dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
			return nil
		}})
		lt.submit("full-1")
		time.Sleep(500 * time.Millisecond) // a few refused publishes
		if err := st.DeleteMsg(ctx, filler.Sequence); err != nil {
			t.Fatal(err)
		}
		dispatchertest.WaitFor(t, "the handoff", func() bool { return lt.pending(dispatcher.StageDecode) == 1 })
		dispatchertest.WaitFor(t, "the prefill acked", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		if calls.Load() != 1 {
			t.Errorf("the prefill ran %d times, want once", calls.Load())
		}
	})

	// admit skips decoding a record still at the revision its job was
	// queued under: a record written since must still stop the job.
	for _, tc := range []struct {
		name   string
		change func(*dispatcher.Record)
		runs   bool
	}{
		{"unchanged", nil, true},
		{"ended", func(r *dispatcher.Record) { r.State = dispatcher.StateCancelled }, false},
		{"superseded", func(r *dispatcher.Record) { r.Generation++ }, false},
		{"taken over", func(r *dispatcher.Record) { r.Gateway = "gw-other" }, false},
		{"rewritten as it was", func(*dispatcher.Record) {}, true},
	} {
		t.Run("a job whose record was "+tc.name+" after it was queued", func(t *testing.T) {
			pool := dispatcher.PoolName(t.Name())
			if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Minute); err != nil {
				t.Fatal(err)
			}
			lt := &loopTest{t: t, nc: nc, js: js, pool: pool}
			var err error
			if lt.replies, err = reply.NewReplies(nc, "gw-"+pool); err != nil {
				t.Fatal(err)
			}
			defer lt.replies.Close()
			id := "rev-" + pool
			job := &dispatcher.Job{ID: id, Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`),
				ReplyTo: lt.replies.Subject(id), Deadline: time.Now().Add(time.Minute)}
			lt.submitJob(job)
			if job.RecordRevision == 0 {
				t.Fatal("Submit queued the job without its record's revision")
			}
			if tc.change != nil {
				records, _ := dispatcher.OpenRecords(ctx, js)
				if _, err := records.Transition(ctx, id, func(r *dispatcher.Record) error {
					tc.change(r)
					return nil
				}); err != nil {
					t.Fatal(err)
				}
			}
			var calls atomic.Int32
			lt2 := startLoopOn(t, nc, js, pool, Config{Handler: func(context.Context, *Delivery) error {
				calls.Add(1)
				return nil
			}})
			dispatchertest.WaitFor(t, "the job settled", func() bool { return lt2.pending(dispatcher.StagePrefill) == 0 })
			if ran := calls.Load() > 0; ran != tc.runs {
				t.Errorf("the job ran: %v, want %v", ran, tc.runs)
			}
		})
	}

}

// TestHandoffGenerations checks the decode stage's two ways back to
// prefill: a handoff too old for its KV (released, since no engine read
// it, unless it is so old that the lease has surely freed it), and a
// redelivered one (not released: an engine may have read it).
func TestHandoffGenerations(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name        string
		age         time.Duration
		crashes     int
		claimed     bool // its KV claimed by a delivery NATS has forgotten
		wantRelease int32
		wantWaste   verdict.Waste // the wasted prefill's reason
	}{
		{"older than the KV TTL", 10400 * time.Millisecond, 0, false, 1, verdict.WasteKVTTL},
		{"older than the lease", 30 * time.Second, 0, false, 0, verdict.WasteKVTTL},
		{"redelivered after a crash", 0, 1, false, 0, verdict.WasteRedelivered},
		// A restarted nats-server delivers it again as a first delivery.
		{"delivered again as a first", 0, 0, true, 0, verdict.WasteRedelivered},
		{"older than the KV TTL and claimed", 10400 * time.Millisecond, 0, true, 0, verdict.WasteRedelivered},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := dispatcher.PoolName(t.Name())
			id := "gen-" + strings.ReplaceAll(tc.name, " ", "-")
			var ran, released atomic.Int32
			metrics, err := NewMetrics(prometheus.NewRegistry(), nil)
			if err != nil {
				t.Fatal(err)
			}
			cfg := Config{Stage: dispatcher.StageDecode, Pool: pool, Slots: 1, PullWait: 100 * time.Millisecond, KVTTL: 10 * time.Second, AckWait: 300 * time.Millisecond,
				Handler: func(context.Context, *Delivery) error { ran.Add(1); return nil },
				Release: func(context.Context, *dispatcher.Job) error { released.Add(1); return nil }, Metrics: metrics}
			records, _ := dispatcher.OpenRecords(ctx, js)
			job := &dispatcher.Job{ID: id, Model: "m", Pool: pool, Endpoint: openai.Chat, Body: []byte(`{}`),
				Deadline: time.Now().Add(time.Minute)}
			if _, err := submit.NewSubmitter(js, records, registry.NewLiveness(nc)).Submit(ctx, dispatcher.StagePrefill, job); err != nil {
				t.Fatal(err)
			}
			// The prefill stage's work, done by hand: the handoff, and the
			// prefill job acked.
			pcons, _ := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Second)
			pm, err := pcons.Next(jetstream.FetchMaxWait(5 * time.Second))
			if err != nil {
				t.Fatal(err)
			}
			job.KV = []byte(`{"remote_block_ids":[1],"remote_request_id":"` + id + `"}`)
			job.Prefill = &dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Generation: 1, Started: time.Now().Add(-tc.age)}
			if _, err := js.PublishMsg(ctx, job.Msg(dispatcher.StageDecode)); err != nil {
				t.Fatal(err)
			}
			pm.Ack()
			dcons, _ := dispatcher.EnsureConsumer(ctx, js, dispatcher.StageDecode, pool, 300*time.Millisecond)
			for range tc.crashes {
				if _, err := dcons.Next(jetstream.FetchMaxWait(5 * time.Second)); err != nil {
					t.Fatal(err)
				}
			}
			if tc.claimed {
				reads, err := dispatcher.OpenKVReads(ctx, js)
				if err != nil {
					t.Fatal(err)
				}
				if ok, err := reads.Claim(ctx, job, "forgotten"); !ok || err != nil {
					t.Fatalf("claim: %v %v", ok, err)
				}
			}
			loop, err := NewLoop(nc, js, withSettings(cfg), logging.Discard())
			if err != nil {
				t.Fatal(err)
			}
			lctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); loop.Run(lctx) }()
			defer func() { cancel(); <-done }()
			st, _ := js.Stream(ctx, dispatcher.StreamPrefill)
			var m *jetstream.RawStreamMsg
			// The first generation's job goes when its ack, sent above
			// without waiting, is processed: until then it is the last.
			dispatchertest.WaitFor(t, "the next generation's prefill job", func() bool {
				m, err = st.GetLastMsgForSubject(ctx, dispatcher.JobSubject(dispatcher.StagePrefill, pool, id))
				return err == nil && m.Header.Get(dispatcher.HeaderGeneration) != "1"
			})
			next, err := dispatcher.ParseJob(m.Header, m.Data)
			if err != nil || next.Generation != 2 || m.Header.Get(jetstream.MsgIDHeader) != id+"/p2" || len(next.KV) != 0 {
				t.Errorf("prefill job headers %v, KV %s (%v): want generation 2 without KV params", m.Header, next.KV, err)
			}
			dispatchertest.WaitFor(t, "the record in generation 2", func() bool {
				r, _, _ := records.Get(ctx, id)
				return r.Generation == 2 && r.State == dispatcher.StateQueued
			})
			if ran.Load() != 0 || released.Load() != tc.wantRelease {
				t.Errorf("decode ran %d times and released %d; want 0 and %d", ran.Load(), released.Load(), tc.wantRelease)
			}
			for _, reason := range verdict.WasteReasons() {
				want := 0.0
				if reason == tc.wantWaste {
					want = 1
				}
				if got := testutil.ToFloat64(metrics.wastedPrefills.WithLabelValues(string(reason))); got != want {
					t.Errorf("pdq_prefills_wasted_total{reason=%q} = %v, want %v", reason, got, want)
				}
			}
		})
	}
}

// TestPrefillRunAgainReleasesItsKV: a prefill that runs again after its
// handoff was stored (a restarted nats-server forgot the first delivery,
// or its ack came late) finds its handoff a duplicate of the first run's,
// whose params name other blocks: its own KV has no reader, and goes to
// the release queue. A duplicate of its own handoff (a try whose answer
// was lost) releases nothing.
func TestPrefillRunAgainReleasesItsKV(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name       string
		firstKV    string
		wantQueued bool
	}{
		{"an earlier run's handoff stored", `{"remote_request_id":"first"}`, true},
		{"its own handoff stored", `{"remote_request_id":"second"}`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
				d.HandOff([]byte(`{"remote_request_id":"second"}`), dispatcher.StageRecord{Stage: dispatcher.StagePrefill, Started: time.Now()})
				return nil
			}})
			id := "again-" + strings.Fields(tc.name)[1]
			first := &dispatcher.Job{ID: id, Model: "m", Pool: lt.pool, Endpoint: openai.Chat, Body: []byte(`{}`), Generation: 1, Origin: 1,
				KV: []byte(tc.firstKV), Deadline: time.Now().Add(time.Minute)}
			if _, err := js.PublishMsg(ctx, first.Msg(dispatcher.StageDecode)); err != nil {
				t.Fatal(err)
			}
			lt.submit(id)
			dispatchertest.WaitFor(t, "the prefill job acked", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
			st, err := js.Stream(ctx, dispatcher.StreamRelease)
			if err != nil {
				t.Fatal(err)
			}
			m, err := st.GetLastMsgForSubject(ctx, dispatcher.ReleaseSubject(lt.pool, id))
			queued := err == nil
			if queued != tc.wantQueued {
				t.Fatalf("release queued %v (%v), want %v", queued, err, tc.wantQueued)
			}
			if queued {
				rel, err := dispatcher.ParseJob(m.Header, m.Data)
				if err != nil || string(rel.KV) != `{"remote_request_id":"second"}` {
					t.Errorf("release of %s (%v), want the second run's KV", rel.KV, err)
				}
			}
		})
	}
}

// TestFullDLQ: a full dead-letter stream refuses a new entry rather than
// dropping an older one, the refusal is counted, and the client is
// answered at once.
func TestFullDLQ(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	st := limitStream(t, js, dispatcher.StreamDLQ, 1)
	if _, err := js.Publish(ctx, dispatcher.DLQSubject("other", "older-failure"), []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	shared, err := dispatcher.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewMetrics(reg, shared)
	if err != nil {
		t.Fatal(err)
	}
	lt := startLoop(t, nc, js, Config{Metrics: m, Handler: func(context.Context, *Delivery) error {
		return verdict.Permanent(errors.New("engine exploded"), openai.NewError(502, "engine exploded"))
	}})
	s := lt.submit("dlq-full-1")
	r, err := s.Next(ctx, 10*time.Second)
	if err != nil || r.Kind != dispatcher.KindError || r.Status != 502 {
		t.Fatalf("reply %+v %s, %v; want the 502 at once", r, r.Data, err)
	}
	dispatchertest.WaitFor(t, "the job gone", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
	if got := dispatchertest.Value(t, reg, "pdq_dead_letters_refused_total", "prefill"); got != 1 {
		t.Errorf("pdq_dead_letters_refused_total = %v, want 1", got)
	}
	if got := dispatchertest.Value(t, reg, "pdq_dead_letters_total", "prefill"); got != 0 {
		t.Errorf("pdq_dead_letters_total = %v, want 0", got)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Errorf("the DLQ holds %d entries, want the older one only", info.State.Msgs)
	}
	if _, err := st.GetLastMsgForSubject(ctx, dispatcher.DLQSubject("other", "older-failure")); err != nil {
		t.Errorf("the older entry was dropped: %v", err)
	}
	if rec := lt.record("dlq-full-1"); rec.State != dispatcher.StateFailed {
		t.Errorf("record %+v, want failed", rec)
	}
}

// TestReplay: a dead letter is found by id (through its record, or without
// one), replayed once as the next generation, and refused while in flight.
// (The fault suite replays through the whole pipeline, to a done record.)
func TestReplay(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	var fail atomic.Bool
	fail.Store(true)
	lt := startLoop(t, nc, js, Config{Handler: func(context.Context, *Delivery) error {
		if fail.Load() {
			return verdict.Permanent(errors.New("engine exploded"), openai.NewError(502, "engine exploded"))
		}
		return nil
	}})
	for _, id := range []string{"replay-1", "replay-2"} {
		lt.submit(id)
		dispatchertest.WaitFor(t, "the dead letter of "+id, func() bool { return lt.deadLetter(id) != nil })
	}
	bucket, err := js.KeyValue(ctx, dispatcher.BucketRequests)
	if err != nil {
		t.Fatal(err)
	}
	if err := bucket.Delete(ctx, "replay-2"); err != nil { // as if older than the bucket's TTL
		t.Fatal(err)
	}
	rp, err := admin.NewReplayer(ctx, js, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	fail.Store(false)
	for _, id := range []string{"replay-1", "replay-2"} {
		dl, err := rp.Find(ctx, id)
		if err != nil {
			t.Fatalf("find %s: %v", id, err)
		}
		gen, err := rp.Replay(ctx, dl)
		if err != nil || gen != 2 {
			t.Fatalf("replay %s: generation %d, %v; want 2", id, gen, err)
		}
		if _, err := rp.Replay(ctx, dl); !errors.Is(err, admin.ErrLive) {
			t.Errorf("a second replay of %s: %v, want ErrLive", id, err)
		}
		// This loop is a prefill stage with no decode after it: the record
		// stays queued in generation 2, and the job ran and was acked.
		rec := lt.record(id)
		if rec.State != dispatcher.StateQueued || rec.Generation != 2 || rec.Replays != 1 || rec.Gateway != "" {
			t.Errorf("replayed record %+v; want queued in generation 2 after 1 replay, with no gateway", rec)
		}
		dispatchertest.WaitFor(t, "the replayed job run", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
		if _, err := rp.Find(ctx, id); !errors.Is(err, admin.ErrNoDeadLetter) {
			t.Errorf("the dead letter of %s is still there after its replay: %v", id, err)
		}
	}
}

// TestReplayOfAReplacedDeadLetter: a replayed request that fails again
// before the replay removes its dead letter replaces it (one dead letter
// a request): the replay has still done its work, and says so.
func TestReplayOfAReplacedDeadLetter(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	lt := startLoop(t, nc, js, Config{Handler: func(context.Context, *Delivery) error {
		return verdict.Permanent(errors.New("engine exploded"), openai.NewError(502, "engine exploded"))
	}})
	lt.submit("again")
	dispatchertest.WaitFor(t, "the dead letter", func() bool { return lt.deadLetter("again") != nil })
	rp, err := admin.NewReplayer(ctx, js, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	dl, err := rp.Find(ctx, "again")
	if err != nil {
		t.Fatal(err)
	}
	// Another failure of the request lands in its place, as the replayed
	// generation's does when it fails faster than the replay deletes.
	old := lt.deadLetter("again")
	job, err := dispatcher.ParseJob(old.Header, old.Data)
	if err != nil {
		t.Fatal(err)
	}
	job.Generation++
	if err := dispatcher.DeadLetterJob(ctx, js, job, dispatcher.StagePrefill, 502, "failed again", nil); err != nil {
		t.Fatal(err)
	}
	if m := lt.deadLetter("again"); m == nil || m.Sequence == old.Sequence {
		t.Fatalf("the dead letter was not replaced: %+v", m)
	}
	if gen, err := rp.Replay(ctx, dl); err != nil {
		t.Errorf("replay of a dead letter replaced meanwhile: generation %d, %v; want no error", gen, err)
	}
}

// TestHandBack: a job handed back (its worker's engine failing) runs again
// as a first delivery of the same generation, under a new message id, and
// after too many hand-backs is retried as any failure is.
func TestHandBack(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	type run struct{ attempt, generation, handBacks int }
	runs := make(chan run, 20)
	var handBack atomic.Int64
	handBack.Store(2)
	lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
		runs <- run{d.Attempt, d.Job.Generation, d.Job.HandBacks}
		if handBack.Add(-1) >= 0 {
			return verdict.HandBack(errors.New("breaker open"), openai.NewError(503, "engine unavailable"))
		}
		return nil
	}})
	lt.submit("hb-1")
	want := []run{{1, 1, 0}, {1, 1, 1}, {1, 1, 2}}
	for i, w := range want {
		select {
		case got := <-runs:
			if got != w {
				t.Errorf("run %d: %+v, want %+v", i, got, w)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("run %d did not come", i)
		}
	}
	dispatchertest.WaitFor(t, "the job done", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })

	handBack.Store(maxHandBacks + 1)
	lt.submit("hb-2")
	for i := range maxHandBacks + 2 {
		select {
		case got := <-runs:
			if i == maxHandBacks && (got.handBacks != maxHandBacks || got.attempt != 1) {
				t.Errorf("run %d: %+v, want the last hand-back", i, got)
			}
			if i == maxHandBacks+1 && (got.handBacks != maxHandBacks || got.attempt != 2) {
				t.Errorf("run %d: %+v, want a retry of the last copy, delivered again", i, got)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("run %d did not come", i)
		}
	}
}

// TestRunningElsewhere: a loop says whether it runs a delivery of a job
// (same id and generation, another delivery), so that a redelivery made
// while the first still runs is left to it.
func TestRunningElsewhere(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	release := make(chan struct{})
	started := make(chan *dispatcher.Job, 1)
	lt := startLoop(t, nc, js, Config{Handler: func(_ context.Context, d *Delivery) error {
		started <- d.Job
		<-release
		return nil
	}})
	lt.submit("re-1")
	var job *dispatcher.Job
	select {
	case job = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not start")
	}
	other := startLoopOn(t, nc, js, "other-pool", Config{Handler: func(context.Context, *Delivery) error { return nil }})
	var self string // the running delivery's name
	lt.loop.mu.Lock()
	for r := range lt.loop.running {
		self = r.delivery
	}
	lt.loop.mu.Unlock()
	if !other.loop.runningElsewhere(ctx, job, 2, "another") {
		t.Error("a second delivery was not told that the first still runs")
	}
	if !other.loop.runningElsewhere(ctx, job, 1, "another") {
		t.Error("a delivery NATS counts as a first one (a restarted server forgot the first) was not told that the first still runs")
	}
	if lt.loop.runningElsewhere(ctx, job, 1, self) {
		t.Error("a delivery was told that it runs elsewhere: itself")
	}
	next := *job
	next.Generation++
	if other.loop.runningElsewhere(ctx, &next, 1, "another") {
		t.Error("another generation was taken for the one running")
	}
	close(release)
	dispatchertest.WaitFor(t, "the job done", func() bool { return lt.pending(dispatcher.StagePrefill) == 0 })
	// The ack comes a moment before the loop forgets the job.
	dispatchertest.WaitFor(t, "the finished delivery no longer said to run", func() bool { return !other.loop.runningElsewhere(ctx, job, 2, "another") })
}

// TestQueues: the status of a pool's queues, with the age of its oldest
// waiting job.
func TestQueues(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	const pool = "queues"
	if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Second); err != nil {
		t.Fatal(err)
	}
	records, err := dispatcher.OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	job := &dispatcher.Job{ID: "q-1", Model: "m", Pool: pool, Endpoint: openai.Completions, Body: []byte(`{"prompt":"x"}`),
		Submitted: time.Now(), Deadline: time.Now().Add(time.Minute)}
	if _, err := submit.NewSubmitter(js, records, registry.NewLiveness(nc)).Submit(ctx, dispatcher.StagePrefill, job); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	qs, err := admin.Queues(ctx, js, pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(qs) != 1 || qs[0].Stage != dispatcher.StagePrefill || qs[0].Waiting != 1 || qs[0].OldestSeconds < 0.3 || qs[0].OldestSeconds > 60 {
		t.Errorf("queues %+v, want the prefill queue with 1 job waiting for about 0.3 s", qs)
	}
}

// limitStream lowers a stream's message limit, to make it full.
func limitStream(t *testing.T, js jetstream.JetStream, name string, maxMsgs int64) jetstream.Stream {
	t.Helper()
	ctx := context.Background()
	st, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.MaxMsgs = maxMsgs
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestBatchPromptAckConfirmed checks how a job that succeeded is acked: a
// prompt of a batch, whose record ends only with the whole batch's, with
// JetStream's confirmation (a lost ack would run it again while another
// prompt runs); any other job plainly, its redelivery dropped by admit.
func TestBatchPromptAckConfirmed(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	acks, err := nc.SubscribeSync("$JS.ACK.>")
	if err != nil {
		t.Fatal(err)
	}
	lt := startLoop(t, nc, js, Config{Handler: func(context.Context, *Delivery) error { return nil }})
	for _, batch := range []bool{false, true} {
		id := fmt.Sprintf("ack-batch-%v", batch)
		s, err := lt.replies.Open(id)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		lt.submitJob(&dispatcher.Job{ID: id, Model: "m", Pool: lt.pool, Endpoint: openai.Completions, Body: []byte(`{}`),
			ReplyTo: lt.replies.Subject(id), Deadline: time.Now().Add(time.Minute), BatchPrompt: batch})
		for {
			m, err := acks.NextMsg(10 * time.Second)
			if err != nil {
				t.Fatalf("batch %v: no ack: %v", batch, err)
			}
			if string(m.Data) != "+ACK" {
				continue // progress, not the end
			}
			if confirmed := m.Reply != ""; confirmed != batch {
				t.Errorf("batch %v: ack confirmed %v, want %v", batch, confirmed, batch)
			}
			break
		}
	}
}

// TestShutdownDropsNoPulledJob: a job the server hands a loop's waiting
// pull as the loop stops is run or handed back at once, never dropped to
// wait out the ack wait. A dropped handoff comes back as a redelivery,
// which a decode stage must take for one whose KV may have been read: a
// new prefill, and the first one's KV held for its lease.
func TestShutdownDropsNoPulledJob(t *testing.T) {
	nc, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	for i := range 40 {
		var ran atomic.Int32
		pool := fmt.Sprintf("sd-%d", i)
		lt := startLoopOn(t, nc, js, pool, Config{AckWait: time.Minute, Handler: func(context.Context, *Delivery) error {
			ran.Add(1)
			return nil
		}})
		cons, err := js.Consumer(ctx, dispatcher.StageStream(dispatcher.StagePrefill), dispatcher.ConsumerName(dispatcher.StagePrefill, pool))
		dispatchertest.WaitFor(t, "the loop's pull", func() bool {
			if err != nil {
				cons, err = js.Consumer(ctx, dispatcher.StageStream(dispatcher.StagePrefill), dispatcher.ConsumerName(dispatcher.StagePrefill, pool))
				return false
			}
			info, err := cons.Info(ctx)
			return err == nil && info.NumWaiting > 0
		})
		// The job and the stop cross: the stop comes a little later each
		// turn, from before the job's delivery to after it.
		lt.submit(fmt.Sprintf("sd-%d", i))
		time.Sleep(time.Duration(i) * 25 * time.Microsecond)
		lt.stop()
		// A job run was acked without waiting for the server's word: give
		// the ack a moment. A job dropped stays unacked for the ack wait.
		var info *jetstream.ConsumerInfo
		settled := func() bool {
			info, err = cons.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return info.NumAckPending == 0 && uint64(ran.Load())+info.NumPending == 1
		}
		for deadline := time.Now().Add(2 * time.Second); !settled() && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		if !settled() {
			t.Fatalf("turn %d: %d jobs delivered and unacked, %d waiting, %d redelivered, %d run; want the job run or waiting, not held",
				i, info.NumAckPending, info.NumPending, info.NumRedelivered, ran.Load())
		}
	}
}
