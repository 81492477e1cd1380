package dispatcher

import (
	"regexp"
	"strings"
	"testing"
)

func TestValidRequestID(t *testing.T) {
	for id, want := range map[string]bool{
		"abc": true, "A-b_9": true, strings.Repeat("x", 128): true,
		"": false, strings.Repeat("x", 129): false, "a.b": false, "a*": false, "a>": false,
		"a b": false, "a\tb": false, "a/b": false, "ü": false, "a\n": false,
		// the ends of each range, and the bytes just past them
		"azAZ09_-": true, "@": false, "[": false, "`": false, "{": false, "/": false, ":": false,
	} {
		if got := ValidRequestID(id); got != want {
			t.Errorf("ValidRequestID(%q) = %v, want %v", id, got, want)
		}
	}
	// The rule as it was written first: every byte, alone and in an id.
	rule := regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)
	for b := range 256 {
		for _, id := range []string{string([]byte{byte(b)}), "a" + string([]byte{byte(b)}) + "z"} {
			if got, want := ValidRequestID(id), rule.MatchString(id); got != want {
				t.Errorf("ValidRequestID(%q) = %v, want %v", id, got, want)
			}
		}
	}
}

func TestPoolName(t *testing.T) {
	for _, tc := range []struct{ model, wantPrefix string }{
		{"pdq-sim", "pdq-sim"},
		{"meta-llama/Llama-3.1-8B-Instruct", "meta-llama_Llama-3_1-8B-Instruct-"},
		{"a.b", "a_b-"},
		{"a*>", "a__-"},
		{"", "-"},
	} {
		got := PoolName(tc.model)
		if !strings.HasPrefix(got, tc.wantPrefix) || !ValidRequestID(strings.ReplaceAll(got, "-", "_")) {
			t.Errorf("PoolName(%q) = %q, want prefix %q and a clean token", tc.model, got, tc.wantPrefix)
		}
		if tc.model == "pdq-sim" && got != "pdq-sim" {
			t.Errorf("a clean name must stay as it is, got %q", got)
		}
	}
	if PoolName("a.b") == PoolName("a_b") || PoolName("a.b") == PoolName("a/b") {
		t.Error("distinct models share a pool")
	}
	if long := PoolName(strings.Repeat("m", 100)); len(long) > 80 {
		t.Errorf("pool name of a long model is %d chars", len(long))
	}
}
