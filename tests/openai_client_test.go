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
// completions, and two error cases. `make test` installs the package and
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
	_, url := startUp(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "run.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PDQ_URL="+url)
	out, err := cmd.CombinedOutput()
	t.Logf("openai client:\n%s", out)
	if err != nil {
		t.Fatalf("openai client failed: %v", err)
	}
	if n := strings.Count(string(out), "ok   "); n != 5 {
		t.Errorf("%d of 5 checks passed", n)
	}
}
