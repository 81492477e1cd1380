package vllm

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// TestAPIKey checks that every kind of engine call carries the key.
func TestAPIKey(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.URL.Path] = r.Header.Get("Authorization")
		mu.Unlock()
		if r.URL.Path == "/v1/models" {
			w.Write([]byte(`{"object":"list","data":[{"id":"m","max_model_len":4096,"owned_by":"vllm"},{"id":"lora","parent":"m"}]}`))
		}
	}))
	defer srv.Close()
	c, err := New(srv.URL, 1, "k3y")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	models, err := c.Models(ctx)
	if err != nil || len(models) != 2 || models[0].ID != "m" || models[0].MaxModelLen != 4096 || models[1].ID != "lora" ||
		string(models[1].Card) != `{"id":"lora","parent":"m"}` {
		t.Errorf("models %+v, %v", models, err)
	}
	if err := c.Health(ctx); err != nil {
		t.Error(err)
	}
	if err := c.Generate(ctx, "m", "probe"); err != nil {
		t.Error(err)
	}
	if resp, err := c.Do(ctx, http.MethodGet, "/version", nil); err == nil {
		resp.Body.Close()
	}
	if resp, err := c.Post(ctx, openai.Chat, "id", []byte(`{}`)); err == nil {
		resp.Body.Close()
	}
	for _, path := range []string{"/v1/models", "/health", "/v1/completions", "/version", "/v1/chat/completions"} {
		if seen[path] != "Bearer k3y" {
			t.Errorf("%s: Authorization %q", path, seen[path])
		}
	}
}
