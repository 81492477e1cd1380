package sim

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

func newTestEngine(t *testing.T, mutate func(*simconfig.Config)) *Engine {
	t.Helper()
	cfg := simconfig.DefaultConfig()
	if mutate != nil {
		mutate(&cfg)
	}
	e, err := New(cfg, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestParseKVParams(t *testing.T) {
	full := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,4],"remote_engine_id":"e1","remote_request_id":"chatcmpl-x-1234abcd","remote_host":"10.0.0.5","remote_port":5600,"tp_size":2}`
	for _, tc := range []struct {
		name     string
		protocol simconfig.Protocol
		raw      string
		mode     mode
		remote   remote
		errHas   string
	}{
		{name: "absent", raw: ``, mode: modeLocal},
		{name: "null", raw: `null`, mode: modeLocal},
		{name: "empty object", raw: `{}`, mode: modeLocal},
		{name: "router skeleton", raw: `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`, mode: modePrefill},
		{name: "full decode params", raw: full, mode: modeDecode,
			remote: remote{engineID: "e1", requestID: "chatcmpl-x-1234abcd", host: "10.0.0.5", port: 5600, blockIDs: []int{3, 4}, tpSize: 2}},
		{name: "block ids per kv-cache group", raw: strings.Replace(full, `[3,4]`, `[[3,4],[9]]`, 1), mode: modeDecode,
			remote: remote{engineID: "e1", requestID: "chatcmpl-x-1234abcd", host: "10.0.0.5", port: 5600, blockIDs: []int{3, 4, 9}, tpSize: 2}},
		{name: "v1 needs no remote_request_id", protocol: simconfig.ProtocolV1, raw: strings.Replace(full, `"remote_request_id":"chatcmpl-x-1234abcd",`, ``, 1), mode: modeDecode,
			remote: remote{engineID: "e1", host: "10.0.0.5", port: 5600, blockIDs: []int{3, 4}, tpSize: 2}},
		{name: "v2 needs remote_request_id", raw: strings.Replace(full, `"remote_request_id":"chatcmpl-x-1234abcd",`, ``, 1), errHas: "[remote_request_id]"},
		{name: "empty block list", raw: strings.Replace(full, `[3,4]`, `[]`, 1), errHas: "[remote_block_ids]"},
		{name: "string block ids", raw: strings.Replace(full, `[3,4]`, `["DUMMY_ID"]`, 1), errHas: "list of integers"},
		{name: "port out of range", raw: strings.Replace(full, `5600`, `70000`, 1), errHas: "[remote_port]"},
		{name: "host empty", raw: strings.Replace(full, `"10.0.0.5"`, `""`, 1), errHas: "[remote_host]"},
		{name: "port a string", raw: strings.Replace(full, `5600`, `"5600"`, 1), errHas: "invalid kv_transfer_params"},
		{name: "both set", raw: `{"do_remote_decode":true,"do_remote_prefill":true}`, errHas: "both"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEngine(t, func(c *simconfig.Config) {
				if tc.protocol != "" {
					c.Protocol = tc.protocol
				}
			})
			m, r, err := e.parseKVParams(json.RawMessage(tc.raw))
			if tc.errHas != "" {
				if err == nil || !strings.Contains(err.Message, tc.errHas) || err.Code != 400 {
					t.Fatalf("err = %v, want a 400 containing %q", err, tc.errHas)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if m != tc.mode {
				t.Errorf("mode = %v, want %v", m, tc.mode)
			}
			if tc.mode == modeDecode && (r.engineID != tc.remote.engineID || r.requestID != tc.remote.requestID || r.host != tc.remote.host ||
				r.port != tc.remote.port || r.tpSize != tc.remote.tpSize || !slices.Equal(r.blockIDs, tc.remote.blockIDs)) {
				t.Errorf("remote = %+v, want %+v", r, tc.remote)
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	if err := simconfig.DefaultConfig().Validate(); err != nil {
		t.Fatalf("defaults are invalid: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*simconfig.Config)
	}{
		{"protocol", func(c *simconfig.Config) { c.Protocol = "v3" }},
		{"policy", func(c *simconfig.Config) { c.KVLoadFailure = "retry" }},
		{"block size", func(c *simconfig.Config) { c.BlockSize = 0 }},
		{"lease", func(c *simconfig.Config) { c.KVLease = 0 }},
		{"seqs", func(c *simconfig.Config) { c.MaxNumSeqs = 0 }},
		{"negative itl", func(c *simconfig.Config) { c.ITL = -1 }},
		{"fault rate", func(c *simconfig.Config) { c.Fault.Rate = 1.5 }},
		{"fault kind", func(c *simconfig.Config) { c.Fault = simconfig.Fault{Rate: 1, Kind: "boom"} }},
		{"kv port", func(c *simconfig.Config) { c.KVPort = 70000 }},
		{"model", func(c *simconfig.Config) { c.Model = "" }},
	} {
		c := simconfig.DefaultConfig()
		tc.mutate(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: want a validation error", tc.name)
		}
		if _, err := New(c, logging.Discard()); err == nil {
			t.Errorf("%s: New accepted an invalid config", tc.name)
		}
	}
}

func TestDurationJSON(t *testing.T) {
	for in, want := range map[string]simconfig.Duration{`"1.5s"`: simconfig.Duration(1500e6), `250`: simconfig.Duration(250e6), `"0s"`: 0} {
		var d simconfig.Duration
		if err := json.Unmarshal([]byte(in), &d); err != nil || d != want {
			t.Errorf("%s -> %v, %v; want %v", in, d, err, want)
		}
	}
	var d simconfig.Duration
	if err := json.Unmarshal([]byte(`"soon"`), &d); err == nil {
		t.Error("accepted \"soon\"")
	}
	if out, _ := json.Marshal(simconfig.Duration(2e9)); string(out) != `"2s"` {
		t.Errorf("marshal = %s", out)
	}
}
