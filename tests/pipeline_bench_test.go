package tests

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

// BenchmarkPipeline runs streamed P/D chat requests through pdq in this
// process (embedded JetStream, gateway, one prefill and one decode worker,
// zero-latency pdq sim engines), 16 at a time: for CPU and allocation
// profiles of the whole path, e.g.
//
//	go test -run '^$' -bench Pipeline -benchmem -cpuprofile cpu.out ./tests
//
// The engines run in the process too; their share shows under pkg/sim.
func BenchmarkPipeline(b *testing.B) {
	for _, words := range []int{256, 100_000} {
		b.Run(fmt.Sprintf("%dwords", words), func(b *testing.B) {
			p := startPipeline(b, pipelineOptions{sim: simtest.FastConfig(), slots: 64})
			body := `{"model":"pdq-sim","stream":true,"max_tokens":32,"ignore_eos":true,"messages":[{"role":"user","content":"` +
				strings.Repeat("word ", words) + `"}]}`
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			jobs := make(chan int)
			for range 16 {
				wg.Go(func() {
					for range jobs {
						resp, err := http.Post(p.chat(), "application/json", strings.NewReader(body))
						if err != nil {
							b.Error(err)
							continue
						}
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode != http.StatusOK {
							b.Errorf("status %d", resp.StatusCode)
						}
					}
				})
			}
			for i := 0; i < b.N; i++ {
				jobs <- i
			}
			close(jobs)
			wg.Wait()
		})
	}
}
