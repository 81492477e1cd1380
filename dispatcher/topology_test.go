package dispatcher

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// logRecords is a logger whose records a test reads back.
type logRecords struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logRecords) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logRecords) logger() *slog.Logger { return slog.New(slog.NewJSONHandler(l, nil)) }

// warnings returns the WARN records.
func (l *logRecords) warnings() []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(l.buf.String(), "\n") {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) == nil && rec["level"] == "WARN" {
			out = append(out, rec)
		}
	}
	return out
}

// TestEnsureOneOwner: the first process to create a stream, bucket or
// consumer owns its settings; a later one with other settings warns,
// naming the setting and both values, and changes nothing.
func TestEnsureOneOwner(t *testing.T) {
	_, js := startJetStream(t)
	ctx := context.Background()

	t.Run("consumer", func(t *testing.T) {
		pool := PoolName(t.Name())
		var logs logRecords
		if _, err := EnsureConsumer(ctx, js, StagePrefill, pool, time.Second, WithLogger(logs.logger())); err != nil {
			t.Fatal(err)
		}
		if w := logs.warnings(); len(w) != 0 {
			t.Errorf("creating a consumer warned: %v", w)
		}
		c, err := EnsureConsumer(ctx, js, StagePrefill, pool, 5*time.Second, WithLogger(logs.logger()))
		if err != nil {
			t.Fatal(err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.Config.AckWait != time.Second {
			t.Errorf("AckWait = %v after a second EnsureConsumer; want the first's 1s", info.Config.AckWait)
		}
		w := logs.warnings()
		if len(w) != 1 || w[0]["consumer"] != ConsumerName(StagePrefill, pool) || w[0]["setting"] != "ack_wait" ||
			w[0]["stored"] != "1s" || w[0]["wanted"] != "5s" {
			t.Errorf("warnings %v; want one naming ack_wait, stored 1s, wanted 5s", w)
		}
		// The same settings again: no warning.
		if _, err := EnsureConsumer(ctx, js, StagePrefill, pool, time.Second, WithLogger(logs.logger())); err != nil {
			t.Fatal(err)
		}
		if n := len(logs.warnings()); n != 1 {
			t.Errorf("%d warnings after an Ensure with the stored settings; want still 1", n)
		}
	})

	t.Run("streams and buckets", func(t *testing.T) {
		var logs logRecords
		// startJetStream ran Ensure with one replica; the same again is
		// silent.
		if err := Ensure(ctx, js, WithLogger(logs.logger())); err != nil {
			t.Fatal(err)
		}
		if w := logs.warnings(); len(w) != 0 {
			t.Fatalf("Ensure with the stored settings warned: %v", w)
		}
		// Someone edited a stream by hand: pdq leaves it so.
		st, err := js.Stream(ctx, StreamPrefill)
		if err != nil {
			t.Fatal(err)
		}
		cfg := st.CachedInfo().Config
		cfg.MaxAge = 2 * time.Hour
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		if err := Ensure(ctx, js, WithLogger(logs.logger())); err != nil {
			t.Fatal(err)
		}
		info, err := st.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.Config.MaxAge != 2*time.Hour {
			t.Errorf("MaxAge = %v; Ensure overwrote the stored 2h", info.Config.MaxAge)
		}
		w := logs.warnings()
		if len(w) != 1 || w[0]["stream"] != StreamPrefill || w[0]["setting"] != "max_age" || w[0]["stored"] != "2h0m0s" || w[0]["wanted"] != "1h0m0s" {
			t.Errorf("warnings %v; want one naming max_age of %s", w, StreamPrefill)
		}
		// More replicas than one server can hold: a clear error when
		// creating, a warning for what exists.
		if err := js.DeleteKeyValue(ctx, BucketWorkers); err != nil {
			t.Fatal(err)
		}
		err = Ensure(ctx, js, WithReplicas(3), WithLogger(logs.logger()))
		if err == nil || !strings.Contains(err.Error(), BucketWorkers) || !strings.Contains(err.Error(), "3 replicas") {
			t.Errorf("Ensure with 3 replicas on one server: %v; want an error naming the bucket and its replicas", err)
		}
		if err := Ensure(ctx, js); err != nil {
			t.Fatal(err)
		}
		if _, err := js.KeyValue(ctx, BucketWorkers); err != nil {
			t.Errorf("a missing bucket was not created again: %v", err)
		}
	})

	t.Run("options", func(t *testing.T) {
		for _, n := range []int{0, 6} {
			if err := Ensure(ctx, js, WithReplicas(n)); !errors.Is(err, ErrInvalidOption) {
				t.Errorf("WithReplicas(%d): %v, want ErrInvalidOption", n, err)
			}
		}
	})
}

// TestUntilAnswered: a look-up that JetStream leaves unanswered, as a
// server does while a new consumer's group elects its leader, or puts off
// (10008), is asked again until it is answered; a refusal is returned at
// once. The requests pass through the test, which answers for JetStream.
func TestUntilAnswered(t *testing.T) {
	nc, _ := startJetStream(t)
	var mu sync.Mutex
	var replies []string // what the test does with the next consumer info requests: "drop", or an answer
	asked := 0
	sub, err := nc.Subscribe("proxy.API.>", func(m *nats.Msg) {
		mu.Lock()
		var reply string
		if strings.HasPrefix(m.Subject, "proxy.API.CONSUMER.INFO.") {
			asked++
			if len(replies) > 0 {
				reply, replies = replies[0], replies[1:]
			}
		}
		mu.Unlock()
		switch reply {
		case "drop":
			return
		case "":
			resp, err := nc.Request("$JS.API."+strings.TrimPrefix(m.Subject, "proxy.API."), m.Data, 2*time.Second)
			if err == nil {
				m.RespondMsg(&nats.Msg{Header: resp.Header, Data: resp.Data})
			}
		default:
			m.Respond([]byte(reply))
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	js, err := jetstream.NewWithAPIPrefix(nc, "proxy.API", jetstream.WithDefaultTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	const (
		unavailable = `{"type":"io.nats.jetstream.api.v1.consumer_info_response","error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}`
		refused     = `{"type":"io.nats.jetstream.api.v1.consumer_info_response","error":{"code":503,"err_code":10039,"description":"jetstream not enabled for account"}}`
	)
	for _, tc := range []struct {
		name    string
		replies []string
		ok      bool
		asked   int
	}{
		{"unanswered twice", []string{"drop", "drop"}, true, 3},
		{"temporarily unavailable", []string{unavailable}, true, 2},
		{"refused", []string{refused}, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			replies, asked = tc.replies, 0
			mu.Unlock()
			var logs logRecords
			err := UntilAnswered(t.Context(), logs.logger(), "the consumer", func(ctx context.Context) error {
				_, err := EnsureConsumer(ctx, js, StagePrefill, "until-answered", time.Second)
				return err
			})
			mu.Lock()
			n := asked
			mu.Unlock()
			if (err == nil) != tc.ok || n != tc.asked {
				t.Errorf("err %v after %d consumer info requests; want ok %v after %d", err, n, tc.ok, tc.asked)
			}
			if w := logs.warnings(); len(w) != tc.asked-1 || (len(w) > 0 && w[0]["for"] != "the consumer") {
				t.Errorf("warnings %v; want one for each retry, saying what for", w)
			}
		})
	}
}
