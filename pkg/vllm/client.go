// Package vllm is the HTTP client of an OpenAI-compatible vLLM engine, as
// the workers use it: discover the served model, post a generation request
// under a given X-Request-Id, probe health.
package vllm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// idleConnTimeout is below uvicorn's 5 s keep-alive, the server vLLM runs
// on, so the client never reuses a connection the engine is closing: a
// longer one caused intermittent resets in llm-d (peers.md, report 12).
const idleConnTimeout = 4 * time.Second

// Client talks to one engine.
type Client struct {
	base *url.URL
	http *http.Client
	// auth is the Authorization header of every call, empty for none.
	auth string
}

// New returns a client for the engine at baseURL (http://host:port) that
// keeps up to conns connections open to it, and sends apiKey, when set, as
// a bearer token on every call: an engine started with --api-key refuses
// /v1 calls without it.
func New(baseURL string, conns int, apiKey string) (*Client, error) {
	u, err := url.Parse(strings.TrimRight(baseURL, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("engine url %q: want http(s)://host:port", baseURL)
	}
	transport := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        max(conns, 1) * 2,
		MaxIdleConnsPerHost: max(conns, 1) * 2,
		IdleConnTimeout:     idleConnTimeout,
		TLSHandshakeTimeout: 5 * time.Second,
	}
	// No overall timeout: a generation streams for as long as it streams;
	// callers bound requests with their context.
	c := &Client{base: u, http: &http.Client{Transport: transport}}
	if apiKey != "" {
		c.auth = "Bearer " + apiKey
	}
	return c, nil
}

// URL is the engine's base URL as logs, the registry and the stage
// records show it: a password in it is replaced by xxxxx.
func (c *Client) URL() string { return c.base.Redacted() }

// Host is the host part of the engine's URL, without the port.
func (c *Client) Host() string { return c.base.Hostname() }

// Post sends a generation request with X-Request-Id set to requestID, its
// body the concatenation of body. The caller reads and closes the response
// body whatever its status.
func (c *Client) Post(ctx context.Context, endpoint openai.Endpoint, requestID string, body ...[]byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base.String()+endpoint.Path(), http.NoBody)
	if err != nil {
		return nil, err
	}
	// Pieces go out as they are, not copied into one buffer first. The
	// transport writes the headers and a one-buffer body in one go, but
	// flushes the headers on their own before any other reader: a caller
	// with a short body hands it over in one piece. GetBody gives the
	// transport the body again for a retry on a stale connection.
	for _, b := range body {
		req.ContentLength += int64(len(b))
	}
	switch {
	case req.ContentLength == 0:
	case len(body) == 1:
		whole := body[0]
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(whole)), nil }
	default:
		req.GetBody = func() (io.ReadCloser, error) {
			bufs := net.Buffers(slices.Clone(body))
			return io.NopCloser(&bufs), nil
		}
	}
	if req.GetBody != nil {
		req.Body, _ = req.GetBody()
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", requestID)
	c.authorize(req)
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("post %s: %w", endpoint.Path(), err)
	}
	return resp, nil
}

// ErrUnauthorized means the engine refused pdq's key, or the lack of one.
var ErrUnauthorized = errors.New("the engine wants another API key (PDQ_ENGINE_API_KEY)")

// Model is one model an engine serves: a base model under one of its
// served names, or a LoRA adapter.
type Model struct {
	ID string
	// MaxModelLen is the engine's context length for the model; 0 when
	// the engine does not say.
	MaxModelLen int
	// Card is the engine's own entry in /v1/models, as it sent it: pdq's
	// /v1/models lists it unchanged.
	Card json.RawMessage
}

// Models lists the models the engine serves, base models and adapters, in
// the engine's order.
func (c *Client) Models(ctx context.Context) ([]Model, error) {
	resp, err := c.Do(ctx, http.MethodGet, "/v1/models", nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusUnauthorized, http.StatusForbidden:
		return nil, fmt.Errorf("get /v1/models: status %d: %w", resp.StatusCode, ErrUnauthorized)
	default:
		return nil, fmt.Errorf("get /v1/models: status %d", resp.StatusCode)
	}
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list); err != nil {
		return nil, fmt.Errorf("get /v1/models: %w", err)
	}
	models := make([]Model, 0, len(list.Data))
	for _, card := range list.Data {
		var m struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		}
		if json.Unmarshal(card, &m) != nil || m.ID == "" {
			continue
		}
		models = append(models, Model{ID: m.ID, MaxModelLen: m.MaxModelLen, Card: card})
	}
	if len(models) == 0 {
		return nil, fmt.Errorf("get /v1/models: the engine serves no model")
	}
	return models, nil
}

// Do sends any other request to the engine (/tokenize, /version, ...),
// with the engine's key. The caller reads and closes the response body.
func (c *Client) Do(ctx context.Context, method, path string, body []byte) (*http.Response, error) {
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base.String()+path, r)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	c.authorize(req)
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	return resp, nil
}

// Health returns nil when GET /health answers 200.
func (c *Client) Health(ctx context.Context) error {
	resp, err := c.Do(ctx, http.MethodGet, "/health", nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("get /health: status %d", resp.StatusCode)
	}
	return nil
}

// Generate asks the engine for one token of a tiny completion, under
// requestID: proof that it serves requests, which /health alone is not (an
// engine can answer /health and hang every request).
func (c *Client) Generate(ctx context.Context, model, requestID string) error {
	body, err := json.Marshal(map[string]any{"model": model, "prompt": "ping", "max_tokens": 1})
	if err != nil {
		return err
	}
	resp, err := c.Post(ctx, openai.Completions, requestID, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("post %s: status %d", openai.Completions.Path(), resp.StatusCode)
	}
	return nil
}

// authorize sets the engine's API key on req.
func (c *Client) authorize(req *http.Request) {
	if c.auth != "" {
		req.Header.Set("Authorization", c.auth)
	}
}
