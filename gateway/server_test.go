package gateway

import (
	"testing"

	"github.com/pdq-dev/pdq/pkg/config"
	"github.com/pdq-dev/pdq/pkg/logging"
)

// TestNewTakesEverySetting: New fills in no default (they are config's):
// a setting left at zero is an error, not a value; but for the P/D
// threshold, whose 0 sends every prompt through prefill.
func TestNewTakesEverySetting(t *testing.T) {
	base := Config{
		MaxBodyBytes: config.MaxBodyBytes, StallTimeout: config.DefaultStallTimeout, PrefillFallback: config.FallbackDecode,
		Grace: config.DefaultShutdownGrace, RequestTimeout: config.DefaultRequestTimeout, BodyTimeout: config.DefaultBodyTimeout,
		MaxInflightBytes: config.DefaultMaxInflightBytes, MaxQueue: config.DefaultMaxQueue,
	}
	if _, err := New(nil, nil, base, logging.Discard()); err != nil {
		t.Fatalf("every setting given: %v", err)
	}
	for name, unset := range map[string]func(*Config){
		"body limit":        func(c *Config) { c.MaxBodyBytes = 0 },
		"stall time-out":    func(c *Config) { c.StallTimeout = 0 },
		"prefill fallback":  func(c *Config) { c.PrefillFallback = "" },
		"grace":             func(c *Config) { c.Grace = 0 },
		"request time-out":  func(c *Config) { c.RequestTimeout = 0 },
		"body time-out":     func(c *Config) { c.BodyTimeout = 0 },
		"in-flight bytes":   func(c *Config) { c.MaxInflightBytes = 0 },
		"queue bound":       func(c *Config) { c.MaxQueue = 0 },
		"negative P/D line": func(c *Config) { c.MinPromptTokens = -1 },
	} {
		cfg := base
		unset(&cfg)
		if _, err := New(nil, nil, cfg, logging.Discard()); err == nil {
			t.Errorf("no %s: New took it", name)
		}
	}
}
