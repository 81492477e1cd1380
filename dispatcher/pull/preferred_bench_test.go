package pull

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
	"github.com/pdq-dev/pdq/dispatcher/queues"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// BenchmarkPreferredEngine measures two ways of giving a job to the
// engine it prefers first, and to another when that one cannot take it:
//
//   - takeover, pdq's: the engine's own consumer, pulled by its worker;
//     another worker takes over what waits there (TakeOver's looks);
//   - prioritized, JetStream's priority groups (nats-server 2.12 and
//     later): the same consumer, with PriorityPolicyPrioritized; the
//     engine's worker pulls it at priority 0, another worker at
//     priority 1, and the server hands a job to the best pull waiting.
//
// Engine E has one seat; engine F, idle, has four. In "busy", E runs each
// job for 30 ms and the jobs, all preferring E, come at random, 40 ms
// apart on average (E busy 75 % of the time, with a queue now and then;
// no job waits long enough for a take-over); in "over", 20 ms apart (1.5
// times what E runs); in "full", E holds its first job for the whole run. It
// reports the share of jobs E ran (what affinity is for) and how long a
// job waited from its publish to a worker's hands, on average and at most.
// Run it with -benchtime=1x: each iteration is a 2-second scenario.
func BenchmarkPreferredEngine(b *testing.B) {
	for _, scenario := range []string{"busy", "over", "full"} {
		for _, mode := range []string{"takeover", "prioritized"} {
			b.Run(scenario+"/"+mode, func(b *testing.B) {
				var share, mean, most float64
				for range b.N {
					s, m, x := preferredScenario(b, mode, scenario)
					share, mean, most = share+s, mean+m, max(most, x)
				}
				b.ReportMetric(share/float64(b.N)*100, "%E")
				b.ReportMetric(mean/float64(b.N), "ms-wait-mean")
				b.ReportMetric(most, "ms-wait-max")
			})
		}
	}
}

func preferredScenario(b *testing.B, mode, scenario string) (shareE, meanMs, maxMs float64) {
	full := scenario == "full"
	gap := 40 * time.Millisecond
	if scenario == "over" {
		gap = 20 * time.Millisecond
	}
	_, js := dispatchertest.JetStream(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool := dispatcher.PoolName(fmt.Sprintf("bench-%s-%s-%d", mode, scenario, time.Now().UnixNano()))
	e, f := dispatcher.EngineKey("http://e"), dispatcher.EngineKey("http://f")
	const ackWait = 5 * time.Second
	var cons jetstream.Consumer
	var err error
	if mode == "prioritized" {
		cons, err = js.CreateConsumer(ctx, dispatcher.StreamPrefill, jetstream.ConsumerConfig{
			Durable:        dispatcher.EngineConsumerName(dispatcher.StagePrefill, pool, e),
			FilterSubject:  dispatcher.StageSubject(dispatcher.StagePrefill) + "." + pool + ".*." + e,
			AckPolicy:      jetstream.AckExplicitPolicy,
			AckWait:        ackWait,
			PriorityPolicy: jetstream.PriorityPolicyPrioritized,
			PriorityGroups: []string{"jobs"},
		})
	} else {
		cons, err = dispatcher.EnsureEngineConsumer(ctx, js, dispatcher.StagePrefill, pool, e, ackWait)
	}
	if err != nil {
		b.Fatal(err)
	}

	var mu sync.Mutex
	ran, waits := map[string]int{}, []time.Duration{}
	took := func(engine string, m jetstream.Msg) {
		sent, _ := strconv.ParseInt(string(m.Data()), 10, 64)
		mu.Lock()
		ran[engine]++
		waits = append(waits, time.Since(time.Unix(0, sent)))
		mu.Unlock()
	}
	fetch := func(priority uint8, wait time.Duration) (jetstream.Msg, bool) {
		opts := []jetstream.FetchOpt{jetstream.FetchMaxWait(wait)}
		if mode == "prioritized" {
			opts = []jetstream.FetchOpt{jetstream.FetchMaxWait(wait), jetstream.FetchPriorityGroup("jobs"), jetstream.FetchPrioritized(priority)}
		}
		batch, err := cons.Fetch(1, opts...)
		if err != nil {
			return nil, false
		}
		for m := range batch.Messages() {
			return m, true
		}
		return nil, false
	}
	var workers sync.WaitGroup
	// E: one seat, 30 ms a job; or, full, its first job for good.
	workers.Go(func() {
		for ctx.Err() == nil {
			m, ok := fetch(0, 200*time.Millisecond)
			if !ok {
				continue
			}
			took("E", m)
			if full {
				<-ctx.Done()
				return
			}
			time.Sleep(30 * time.Millisecond)
			_ = m.Ack()
		}
	})
	// F: idle, with 4 seats for E's jobs whenever it may take them (a
	// prefill worker has 8): a pull waiting for each at priority 1, or a
	// take-over loop that starts each job it takes on a free seat.
	const seatsF = 4
	seats := make(chan struct{}, seatsF)
	run := func(m jetstream.Msg) {
		took("F", m)
		time.Sleep(30 * time.Millisecond)
		_ = m.Ack()
		<-seats
	}
	if mode == "prioritized" {
		for range seatsF {
			workers.Go(func() {
				for ctx.Err() == nil {
					seats <- struct{}{}
					if m, ok := fetch(1, 200*time.Millisecond); ok {
						run(m)
					} else {
						<-seats
					}
				}
			})
		}
	} else {
		workers.Go(func() {
			// The pool's shared consumer, which a report needs, and the watch
			// that lists for the take-over.
			if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, ackWait); err != nil {
				b.Error(err)
				return
			}
			watch, err := queues.Open(ctx, js, dispatcher.StagePrefill, pool, queues.Options{Publish: true})
			if err != nil {
				b.Error(err)
				return
			}
			look := NewTakeOver(js, watch, dispatcher.StagePrefill, pool, f, ackWait, logging.Discard())
			t := time.NewTicker(TakeOverEvery)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				for _, stuck := range look.Look(ctx, len(seats) == seatsF) {
					for range stuck.Jobs {
						seats <- struct{}{}
						batch, err := stuck.Consumer.Fetch(1, jetstream.FetchMaxWait(TakeOverWait))
						var m jetstream.Msg
						if err == nil {
							for msg := range batch.Messages() {
								m = msg
							}
						}
						if m == nil {
							<-seats
							break
						}
						workers.Go(func() { run(m) })
					}
				}
			}
		})
	}
	time.Sleep(300 * time.Millisecond) // both pulling
	const jobs = 50
	arrivals := rand.New(rand.NewPCG(1, 2)) // the same every run
	for i := range jobs {
		subject := dispatcher.PreferredSubject(dispatcher.StagePrefill, pool, "job"+strconv.Itoa(i), e)
		if _, err := js.Publish(ctx, subject, []byte(strconv.FormatInt(time.Now().UnixNano(), 10))); err != nil {
			b.Fatal(err)
		}
		time.Sleep(time.Duration(arrivals.ExpFloat64() * float64(gap)))
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		n := ran["E"] + ran["F"]
		mu.Unlock()
		if n == jobs || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	workers.Wait()
	mu.Lock()
	defer mu.Unlock()
	if len(waits) != jobs {
		b.Fatalf("%s: %d of %d jobs ran", mode, len(waits), jobs)
	}
	var sum time.Duration
	for _, w := range waits {
		sum += w
		maxMs = max(maxMs, float64(w)/float64(time.Millisecond))
	}
	return float64(ran["E"]) / jobs, float64(sum) / float64(len(waits)) / float64(time.Millisecond), maxMs
}
