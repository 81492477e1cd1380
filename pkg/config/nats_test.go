package config

import (
	"errors"
	"testing"
)

func TestNATSValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		n    NATS
		ok   bool
	}{
		{"defaults", NATS{Replicas: 1}, true},
		{"user and password", NATS{Replicas: 3, User: "pdq", Password: "secret"}, true},
		{"token", NATS{Replicas: 1, Token: "t"}, true},
		{"creds and TLS", NATS{Replicas: 1, Creds: "a.creds", CA: "ca.pem", Cert: "c.pem", Key: "k.pem"}, true},
		{"no replicas", NATS{}, false},
		{"six replicas", NATS{Replicas: 6}, false},
		{"password without user", NATS{Replicas: 1, Password: "secret"}, false},
		{"user and token", NATS{Replicas: 1, User: "pdq", Token: "t"}, false},
		{"token and creds", NATS{Replicas: 1, Token: "t", Creds: "a.creds"}, false},
		{"cert without key", NATS{Replicas: 1, Cert: "c.pem"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.n.Validate()
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalid)) {
				t.Errorf("Validate() = %v, want ok %v", err, tc.ok)
			}
		})
	}
}

func TestLoadNATS(t *testing.T) {
	t.Setenv("PDQ_NATS_USER", "pdq")
	t.Setenv("PDQ_NATS_PASSWORD", "secret")
	t.Setenv("PDQ_NATS_REPLICAS", "3")
	n, err := LoadNATS()
	if err != nil || n.User != "pdq" || n.Password != "secret" || n.Replicas != 3 {
		t.Errorf("LoadNATS() = %+v, %v", n, err)
	}
	t.Setenv("PDQ_NATS_TOKEN", "t")
	if _, err := LoadNATS(); !errors.Is(err, ErrInvalid) {
		t.Errorf("LoadNATS() with a user and a token: %v, want ErrInvalid", err)
	}
}

// TestLoadReadsNATS: the services read the same PDQ_NATS_* names as the
// tools.
func TestLoadReadsNATS(t *testing.T) {
	for k, v := range map[string]string{"PDQ_NATS_USER": "pdq", "PDQ_NATS_PASSWORD": "secret", "PDQ_NATS_REPLICAS": "3",
		"PDQ_NATS_CA": "ca.pem", "PDQ_NATS_CERT": "c.pem", "PDQ_NATS_KEY": "k.pem"} {
		t.Setenv(k, v)
	}
	c, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	want := NATS{Replicas: 3, User: "pdq", Password: "secret", CA: "ca.pem", Cert: "c.pem", Key: "k.pem"}
	if c.NATS != want {
		t.Errorf("Load().NATS = %+v, want %+v", c.NATS, want)
	}
}
