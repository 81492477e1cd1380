package dispatcher

import (
	"errors"
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

func TestRequestKey(t *testing.T) {
	long := strings.Repeat("0123456789abcdef", 16)
	for _, tc := range []struct {
		id   string
		kept bool // the key is the id itself
		bad  bool
	}{
		{id: "abc-123_X", kept: true},
		{id: strings.Repeat("a", 124), kept: true},
		// Room for a batch's -<i> is kept: longer tokens are hashed.
		{id: strings.Repeat("a", 125)},
		{id: "req.1:abc"}, {id: "a b"}, {id: "pdq.reply.x.>"}, {id: "a*"}, {id: "x/y?z=%41#"},
		{id: " ~"}, {id: long},
		// A hashed key sent as an id is hashed again: no kept id is another's key.
		{id: "pdqid_0123456789abcdef0123456789abcdef"},
		{id: "", bad: true}, {id: long + "x", bad: true}, {id: "a\tb", bad: true}, {id: "a\nb", bad: true},
		{id: "a\x7fb", bad: true}, {id: "caf\u00e9", bad: true}, {id: "\x00", bad: true},
	} {
		key, err := RequestKey(tc.id)
		switch {
		case tc.bad:
			if !errors.Is(err, ErrInvalidRequestID) {
				t.Errorf("RequestKey(%q) = %q, %v; want ErrInvalidRequestID", tc.id, key, err)
			}
			continue
		case err != nil:
			t.Errorf("RequestKey(%q): %v", tc.id, err)
			continue
		case tc.kept && key != tc.id:
			t.Errorf("RequestKey(%q) = %q; want the id itself", tc.id, key)
		case !tc.kept && (!strings.HasPrefix(key, "pdqid_") || len(key) != 38):
			t.Errorf("RequestKey(%q) = %q; want pdqid_ and 32 hex digits", tc.id, key)
		}
		if again, _ := RequestKey(tc.id); again != key {
			t.Errorf("RequestKey(%q) gave %q, then %q", tc.id, key, again)
		}
		// Every key, with a batch's largest suffix, is a request id.
		if !ValidRequestID(key) || !ValidRequestID(key+"-255") {
			t.Errorf("RequestKey(%q) = %q: not a request id with room for -255", tc.id, key)
		}
	}
	a, _ := RequestKey("a b")
	b, _ := RequestKey("a  b")
	if a == b {
		t.Error("two ids share a key")
	}
}
