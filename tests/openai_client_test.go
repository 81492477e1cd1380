package tests

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestOpenAIClient runs the official OpenAI Node client (tests/openai-client,
// pinned with a lock file) against a live `pdq up`: chat streamed and not,
// completions, an image part, a LoRA adapter, batched prompts, and two
// error cases. `make test` installs the package and
// sets PDQ_REQUIRE_OPENAI_CLIENT, so there the test cannot be skipped.
func TestOpenAIClient(t *testing.T) {
	dir, err := filepath.Abs("openai-client")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "openai")); err != nil {
		if os.Getenv("PDQ_REQUIRE_OPENAI_CLIENT") != "" {
			t.Fatalf("the openai package is not installed in %s: run `make test` (npm ci)", dir)
		}
		t.Skip("openai npm package not installed; `make test` installs it")
	}
	// pdq up in front of engines that also serve a LoRA adapter.
	lora := []string{"--lora-modules", "sql-lora=/adapters/sql"}
	_, pe := startSimProcess(t, lora...)
	_, de := startSimProcess(t, lora...)
	_, url := startUp(t, "PDQ_PREFILL_ENGINES="+pe.URL, "PDQ_DECODE_ENGINES="+de.URL)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "run.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PDQ_URL="+url, "PDQ_LORA=sql-lora")
	out, err := cmd.CombinedOutput()
	t.Logf("openai client:\n%s", out)
	if err != nil {
		t.Fatalf("openai client failed: %v", err)
	}
	if n := strings.Count(string(out), "ok   "); n != 9 {
		t.Errorf("%d of 9 checks passed", n)
	}
}
