package sim_test

import (
	"bytes"
	"net/http"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/simtest"
)

func TestRequestRecorder(t *testing.T) {
	e := simtest.Start(t, fast(func(c *simconfig.Config) { c.APIKey = "k" }))
	// Odd spacing and key order: the record is the bytes, not a re-encoding.
	body := []byte("{ \"prompt\" : \"hi\",\n \"model\":\"pdq-sim\", \"max_tokens\": 2 ,\"x\":\"\\u00e9\"}")
	call(t, http.MethodPost, e.URL+"/v1/completions", body, "X-Request-Id", "rec-1", "Authorization", "Bearer k").want(t, http.StatusOK)
	call(t, http.MethodPost, e.URL+"/v1/completions", body, "X-Request-Id", "rec-1").want(t, http.StatusUnauthorized)
	call(t, http.MethodGet, e.URL+"/v1/models", nil, "X-Request-Id", "rec-1", "Authorization", "Bearer k").want(t, http.StatusOK)
	call(t, http.MethodGet, e.URL+"/health", nil).want(t, http.StatusOK)

	rs := e.Requests(t, "rec-1")
	if len(rs) != 3 {
		t.Fatalf("recorded %+v", rs)
	}
	for i, want := range []struct {
		method, path string
		auth         bool
		body         []byte
	}{
		{http.MethodPost, "/v1/completions", true, body},
		{http.MethodPost, "/v1/completions", false, body},
		{http.MethodGet, "/v1/models", true, nil},
	} {
		r := rs[i]
		if r.Method != want.method || r.Path != want.path || r.HasAuth != want.auth || !bytes.Equal(r.Body, want.body) ||
			r.BodyBytes != len(want.body) || r.ID != "rec-1" || (i > 0 && r.Seq <= rs[i-1].Seq) {
			t.Errorf("request %d = %+v, want %+v", i, r, want)
		}
	}
	if rs := e.Requests(t, "unknown"); len(rs) != 0 {
		t.Errorf("unknown id: %+v", rs)
	}
	recent := e.RecentRequests(t)
	if len(recent) != 4 || recent[3].Path != "/health" || recent[3].ID != "" || recent[3].HasAuth || recent[0].Body != nil {
		t.Errorf("recent = %+v", recent)
	}
	for _, r := range recent {
		if strings.HasPrefix(r.Path, "/sim/") {
			t.Errorf("recorded its own route %s", r.Path)
		}
	}
}
