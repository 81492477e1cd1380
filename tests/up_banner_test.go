package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
)

// TestUpTryLine: the line pdq up prints to try works as printed, for the
// engines it runs: it names the model they serve, carries an API key when
// PDQ_API_KEYS asks for one (a placeholder: the key itself is not printed),
// and its prompt is long enough to go through prefill and decode.
func TestUpTryLine(t *testing.T) {
	const served, key = "org/Served-1", "k-secret-1"
	_, pe := startSimProcess(t, "--served-model-name", served)
	_, de := startSimProcess(t, "--served-model-name", served)
	up := startPDQ(t, []string{"PDQ_DATA_DIR=" + t.TempDir(), "PDQ_HTTP_ADDR=127.0.0.1:0", "PDQ_API_KEYS=" + key,
		"PDQ_PREFILL_ENGINES=" + pe.URL, "PDQ_DECODE_ENGINES=" + de.URL}, "up")
	out := up.waitStdout(t, "stream\":true}'")
	if strings.Contains(out, key) {
		t.Fatalf("pdq up printed an API key:\n%s", out)
	}
	m := regexp.MustCompile(`curl -sN (\S+) (?:-H '([^']*)' \\\s+)*-H '([^']*)' \\\s+-d '([^']*)'`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no curl line to try:\n%s", out)
	}
	url, body := m[1], m[4]
	var headers []string
	for _, h := range regexp.MustCompile(`-H '([^']*)'`).FindAllStringSubmatch(out, -1) {
		headers = append(headers, h[1])
	}
	h := http.Header{"X-Request-Id": {"try-line"}}
	sawAuth := false
	for _, line := range headers {
		name, value, _ := strings.Cut(line, ": ")
		if name == "Authorization" {
			sawAuth = true
			value = "Bearer " + key // for the placeholder
		}
		h.Set(name, value)
	}
	if !sawAuth {
		t.Errorf("with PDQ_API_KEYS set, the line to try has no Authorization header:\n%s", out)
	}
	var b map[string]any
	if err := json.Unmarshal([]byte(body), &b); err != nil {
		t.Fatalf("the line's body %q: %v", body, err)
	}
	if b["model"] != served {
		t.Errorf("the line's model is %v, want the engines' served name %q", b["model"], served)
	}
	// Until the gateway sees the prefill worker, long prompts go
	// decode-only too: the line is sent again, under a new id, until one
	// goes through prefill or 20 s have passed.
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		id := fmt.Sprintf("try-line-%d", i)
		h.Set("X-Request-Id", id)
		r, err := tryDo(http.MethodPost, url, h, b)
		if err != nil || r.status != http.StatusOK {
			t.Fatalf("the line to try: %v %d %s", err, r.status, r.body)
		}
		g, err := tryDo(http.MethodGet, strings.TrimSuffix(url, "/chat/completions")+"/requests/"+id, http.Header{"Authorization": {"Bearer " + key}}, nil)
		var rec dispatcher.Record
		if err != nil || json.Unmarshal(g.body, &rec) != nil {
			t.Fatalf("the record of %s: %v %s", id, err, g.body)
		}
		if !rec.DecodeOnly {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the line to try skips prefill (its prompt is under PDQ_DISAGG_MIN_PROMPT_TOKENS): %s", g.body)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
