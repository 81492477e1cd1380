package tests

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/sim"
)

// TestLongestPromptThroughUp sends a P/D request of the largest body the
// gateway accepts through `pdq up`, with engines whose context holds its
// 1.2 million tokens: the handoff's kv_transfer_params (some 80,000 block
// ids, half a megabyte) must reach the decode engine, which reads the KV
// instead of computing the prompt again. A byte more is a 413.
// sizedBody is a completions body of exactly size bytes, its prompt
// words, asking for maxTokens: the largest prompt pdq takes is
// sizedBody(config.MaxBodyBytes, n).
func sizedBody(size, maxTokens int) string {
	head := `{"model":"` + model + `","max_tokens":` + strconv.Itoa(maxTokens) + `,"ignore_eos":true,"prompt":"`
	const tail = `"}`
	words := strings.Repeat("lorem ipsum dolor sit amet ", size/27+1)
	return head + words[:size-len(head)-len(tail)] + tail
}

func TestLongestPromptThroughUp(t *testing.T) {
	if testing.Short() {
		t.Skip("runs pdq up and two engines as processes")
	}
	engine := []string{"--max-model-len", "4000000", "--prefill-per-token", "0", "--kv-transfer-per-block", "0", "--kv-lease", "60s"}
	_, prefill := startSimProcess(t, engine...)
	_, decode := startSimProcess(t, engine...)
	up := startPDQ(t, []string{"PDQ_DATA_DIR=" + t.TempDir(), "PDQ_HTTP_ADDR=127.0.0.1:0",
		"PDQ_PREFILL_ENGINES=" + prefill.URL, "PDQ_DECODE_ENGINES=" + decode.URL}, "up")
	url := "http://" + up.waitLog(t, "gateway listening")["addr"].(string)
	waitServing(t, url)

	before := decode.Stats(t)
	r := do(t, http.MethodPost, url+"/v1/completions", http.Header{"Content-Type": {"application/json"}}, sizedBody(config.MaxBodyBytes, 2))
	res, _ := parseResponse(t, r)
	if res.usage.CompletionTokens != 2 || res.usage.PromptTokens < 1_000_000 {
		t.Errorf("usage %+v: want 2 tokens for a prompt of over a million", res.usage)
	}
	after := decode.Stats(t)
	if after.KVReads-before.KVReads != 1 || after.Local != before.Local {
		t.Errorf("decode engine %+v after %+v: want the prompt's KV read, not computed again", after, before)
	}
	if s, err := prefill.Poll(testTimeout, func(s sim.Stats) bool { return s.BlocksHeld == 0 }); err != nil {
		t.Errorf("prefill engine %+v: the blocks read are still held: %v", s, err)
	}

	if r := do(t, http.MethodPost, url+"/v1/completions", http.Header{"Content-Type": {"application/json"}}, sizedBody(config.MaxBodyBytes+1, 2)); r.status != http.StatusRequestEntityTooLarge {
		t.Errorf("a body a byte over the limit: %d %s, want 413", r.status, r.body)
	}
}
