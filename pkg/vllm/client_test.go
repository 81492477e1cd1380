package vllm

import (
	"bytes"
	"context"
	"io"
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

// TestPostPieces checks that a body given as pieces reaches the engine as
// their concatenation, with its length, short (joined) or long (sent as
// the pieces).
func TestPostPieces(t *testing.T) {
	type got struct {
		body   []byte
		length int64
	}
	bodies := make(chan got, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies <- got{b, r.ContentLength}
	}))
	defer srv.Close()
	c, err := New(srv.URL, 1, "")
	if err != nil {
		t.Fatal(err)
	}
	long := bytes.Repeat([]byte("x"), 100<<10)
	for _, pieces := range [][][]byte{
		{[]byte(`{"a":1}`)},
		{[]byte(`{"a":1`), []byte(`,"b":2`), []byte(`}`)},
		{[]byte(`{"p":"`), long, []byte(`","k":1}`)},
		{},
	} {
		resp, err := c.Post(context.Background(), openai.Chat, "id-1", pieces...)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		want := bytes.Join(pieces, nil)
		g := <-bodies
		if !bytes.Equal(g.body, want) || g.length != int64(len(want)) {
			t.Errorf("engine got %d bytes (Content-Length %d), want %d", len(g.body), g.length, len(want))
		}
	}
}
