package dispatcher_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/dispatchertest"
)

// TestPoolConsumers: a pool's consumers are its shared one and its
// engines', not those of a pool whose name it starts ("pdq" and
// "pdq-sim"); and the shared one's filter, made as builds before affinity
// made it, is narrowed so that the engines' may exist beside it.
func TestPoolConsumers(t *testing.T) {
	_, js := dispatchertest.JetStream(t)
	ctx := context.Background()
	if err := dispatcher.Ensure(ctx, js); err != nil {
		t.Fatal(err)
	}
	// pdq's shared consumer as a build before affinity made it.
	if _, err := js.CreateConsumer(ctx, dispatcher.StreamPrefill, jetstreamConsumer("prefill-pdq", "pdq.prefill.pdq.>")); err != nil {
		t.Fatal(err)
	}
	for _, pool := range []string{"pdq", "pdq-sim"} {
		if _, err := dispatcher.EnsureConsumer(ctx, js, dispatcher.StagePrefill, pool, time.Second); err != nil {
			t.Fatal(err)
		}
		for _, engine := range []string{"http://a", "http://b"} {
			if _, err := dispatcher.EnsureEngineConsumer(ctx, js, dispatcher.StagePrefill, pool, dispatcher.EngineKey(engine), time.Second); err != nil {
				t.Fatalf("pool %s, engine %s: %v", pool, engine, err)
			}
		}
	}
	infos, err := dispatcher.PoolConsumers(ctx, js, dispatcher.StagePrefill, "pdq")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, info := range infos {
		names = append(names, info.Name)
	}
	slices.Sort(names)
	want := []string{"prefill-pdq", "prefill-pdq-" + dispatcher.EngineKey("http://a"), "prefill-pdq-" + dispatcher.EngineKey("http://b")}
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Errorf("pool pdq's consumers %v, want %v", names, want)
	}
	if engines, _ := dispatcher.EngineConsumers(ctx, js, dispatcher.StagePrefill, "pdq"); len(engines) != 2 {
		t.Errorf("%d engine consumers of pool pdq, want 2", len(engines))
	}
}

func jetstreamConsumer(name, filter string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{Durable: name, FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy}
}
