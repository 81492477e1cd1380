package config

import (
	"errors"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"
)

func TestLoad(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		check   func(t *testing.T, c Config)
		wantErr bool
	}{
		{
			name: "defaults",
			check: func(t *testing.T, c Config) {
				if c.HTTPAddr != ":8000" || c.Log.Level != "info" || c.Log.Format != "" || c.NATSURL != "" {
					t.Errorf("defaults = %+v", c)
				}
			},
		},
		{
			name: "engine lists are split and trimmed",
			env: map[string]string{
				"PDQ_PREFILL_ENGINES": "http://127.0.0.1:8100, http://127.0.0.1:8101,",
				"PDQ_DECODE_ENGINES":  "https://d.example:443",
				"PDQ_LOG_LEVEL":       "debug",
				"PDQ_LOG_FORMAT":      "json",
				"PDQ_ENGINE_SLOTS":    "8",
			},
			check: func(t *testing.T, c Config) {
				if !slices.Equal(c.PrefillEngines, []string{"http://127.0.0.1:8100", "http://127.0.0.1:8101"}) {
					t.Errorf("PrefillEngines = %q", c.PrefillEngines)
				}
				if !slices.Equal(c.DecodeEngines, []string{"https://d.example:443"}) {
					t.Errorf("DecodeEngines = %q", c.DecodeEngines)
				}
				if c.Log.Level != "debug" || c.Log.Format != "json" || c.EngineSlots != 8 {
					t.Errorf("got %+v", c)
				}
			},
		},
		{name: "engine without scheme", env: map[string]string{"PDQ_DECODE_ENGINES": "127.0.0.1:8100"}, wantErr: true},
		{name: "negative slots", env: map[string]string{"PDQ_ENGINE_SLOTS": "-1"}, wantErr: true},
		{name: "slots not a number", env: map[string]string{"PDQ_ENGINE_SLOTS": "many"}, wantErr: true},
		{name: "bad level", env: map[string]string{"PDQ_LOG_LEVEL": "chatty"}, wantErr: true},
		{name: "bad format", env: map[string]string{"PDQ_LOG_FORMAT": "xml"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, k := range []string{"PDQ_PREFILL_ENGINES", "PDQ_DECODE_ENGINES", "PDQ_LOG_LEVEL", "PDQ_LOG_FORMAT", "PDQ_ENGINE_SLOTS", "PDQ_HTTP_ADDR", "PDQ_NATS_URL"} {
				t.Setenv(k, "") // restored after the test
				os.Unsetenv(k)
			}
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			c, err := Load()
			if tc.wantErr {
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("Load() error = %v, want ErrInvalid", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}

// TestUnprefixedNamesIgnored: envconfig falls back to a variable's
// unprefixed name; pdq must not, or every shell's USER would become
// PDQ_NATS_USER (and make PDQ_NATS_TOKEN unusable).
func TestUnprefixedNamesIgnored(t *testing.T) {
	for k, v := range map[string]string{"USER": "root", "KEY": "k.pem", "TOKEN": "t", "LOG_LEVEL": "nonsense",
		"HTTP_ADDR": "1.2.3.4:5", "ENGINE_API_KEY": "leak", "PDQ_NATS_TOKEN": "s3cret"} {
		t.Setenv(k, v)
	}
	c, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS.User != "" || c.NATS.Key != "" || c.NATS.Token != "s3cret" || c.Level != "info" || c.HTTPAddr == "1.2.3.4:5" || c.EngineAPIKey != "" {
		t.Errorf("unprefixed variables leaked into the configuration: %+v", c)
	}
	n, err := LoadNATS()
	if err != nil || n.User != "" || n.Token != "s3cret" {
		t.Errorf("LoadNATS = %+v, %v", n, err)
	}
	if l, err := LoadLog(); err != nil || l.Level != "info" {
		t.Errorf("LoadLog = %+v, %v", l, err)
	}
}

func TestUnknownNames(t *testing.T) {
	got, err := UnknownNames([]string{
		"PATH=/bin", "PDQ_ENGINE_SLOTS=8", // known: nothing to say
		"PDQ_ENGINE_SLOT=8",     // a letter short
		"PDQ_KVTTL=5s",          // an underscore short
		"PDQ_SOMETHING_ELSE=1",  // nothing near
		"PDQ_NATS_URL=nats://x", // known
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []Unknown{
		{Name: "PDQ_ENGINE_SLOT", Nearest: "PDQ_ENGINE_SLOTS"},
		{Name: "PDQ_KVTTL", Nearest: "PDQ_KV_TTL"},
		{Name: "PDQ_SOMETHING_ELSE"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("UnknownNames = %+v, want %+v", got, want)
	}
}

// TestDefaults: what Load gives unset variables is the Default constants,
// the values the constructors are handed (they fill in none of their own).
func TestDefaults(t *testing.T) {
	names, err := Names()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range names {
		t.Setenv(k, "") // restored after the test
		os.Unsetenv(k)
	}
	c, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []struct {
		name      string
		got, want any
	}{
		{"PDQ_DISAGG_MIN_PROMPT_TOKENS", c.DisaggMinPromptTokens, DefaultDisaggMinPromptTokens},
		{"PDQ_REQUEST_TIMEOUT", c.RequestTimeout, time.Duration(DefaultRequestTimeout)},
		{"PDQ_KV_TTL", c.KVTTL, time.Duration(DefaultKVTTL)},
		{"PDQ_ACK_WAIT", c.AckWait, time.Duration(DefaultAckWait)},
		{"PDQ_MAX_GENERATIONS", c.MaxGenerations, DefaultMaxGenerations},
		{"PDQ_MAX_QUEUE", c.MaxQueue, DefaultMaxQueue},
		{"PDQ_BODY_TIMEOUT", c.BodyTimeout, time.Duration(DefaultBodyTimeout)},
		{"PDQ_MAX_INFLIGHT_BYTES", c.MaxInflightBytes, int64(DefaultMaxInflightBytes)},
		{"PDQ_MAX_DELIVER", c.MaxDeliver, DefaultMaxDeliver},
		{"PDQ_PREFILL_TIMEOUT", c.PrefillTimeout, time.Duration(DefaultPrefillTimeout)},
		{"PDQ_STALL_TIMEOUT", c.StallTimeout, time.Duration(DefaultStallTimeout)},
		{"PDQ_MIGRATION_LIMIT", c.MigrationLimit, DefaultMigrationLimit},
		{"PDQ_SHUTDOWN_GRACE", c.ShutdownGrace, time.Duration(DefaultShutdownGrace)},
		{"PDQ_BREAKER_FAILURES", c.BreakerFailures, DefaultBreakerFailures},
		{"PDQ_PREFILL_FALLBACK", c.PrefillFallback, FallbackDecode},
		{"PDQ_FAIR_LIMIT", c.FairLimit, FairLimitSlots},
		{"PDQ_ENGINE_SLOTS (prefill)", c.EngineSlotsFor(true), DefaultPrefillSlots},
		{"PDQ_ENGINE_SLOTS (decode)", c.EngineSlotsFor(false), DefaultDecodeSlots},
	} {
		if d.got != d.want {
			t.Errorf("%s unset gives %v, want %v", d.name, d.got, d.want)
		}
	}
}
