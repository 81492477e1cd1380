package main

import (
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

func TestEngineConfigs(t *testing.T) {
	cfg := simconfig.DefaultConfig()
	cfg.Addr, cfg.KVPort, cfg.EngineID = "127.0.0.1:8100", 5600, "p"
	free := cfg
	free.Addr, free.KVPort, free.EngineID = "127.0.0.1:0", 0, ""
	for _, tc := range []struct {
		name    string
		cfg     simconfig.Config
		n       int
		addrs   []string
		kvPorts []int
		ids     []string
		wantErr bool
	}{
		{name: "one engine is the flags' engine", cfg: cfg, n: 1, addrs: []string{"127.0.0.1:8100"}, kvPorts: []int{5600}, ids: []string{"p"}},
		{name: "consecutive ports", cfg: cfg, n: 3, addrs: []string{"127.0.0.1:8100", "127.0.0.1:8101", "127.0.0.1:8102"},
			kvPorts: []int{5600, 5601, 5602}, ids: []string{"p-0", "p-1", "p-2"}},
		{name: "free ports stay free", cfg: free, n: 2, addrs: []string{"127.0.0.1:0", "127.0.0.1:0"}, kvPorts: []int{0, 0}, ids: []string{"", ""}},
		{name: "none", cfg: cfg, n: 0, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := engineConfigs(tc.cfg, tc.n)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if len(got) != len(tc.addrs) {
				t.Fatalf("%d configs, want %d", len(got), len(tc.addrs))
			}
			for i, c := range got {
				if c.Addr != tc.addrs[i] || c.KVPort != tc.kvPorts[i] || c.EngineID != tc.ids[i] {
					t.Errorf("engine %d: addr %s kv port %d id %q, want %s %d %q", i, c.Addr, c.KVPort, c.EngineID, tc.addrs[i], tc.kvPorts[i], tc.ids[i])
				}
			}
		})
	}
}
