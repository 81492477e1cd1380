package tokenizer_test

import (
	"slices"
	"testing"

	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

func TestBlockHashes(t *testing.T) {
	ids := func(n, from int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = from + i
		}
		return s
	}
	base := tokenizer.BlockHashes(ids(40, 0), "", 16)
	if len(base) != 2 {
		t.Fatalf("40 tokens in 16-token blocks: %d hashes, want 2 (full blocks only)", len(base))
	}
	for _, tc := range []struct {
		name    string
		ids     []int
		adapter string
		same    int // leading hashes equal to base's
	}{
		{"the same prompt, longer", ids(64, 0), "", 2},
		{"the second block differs", append(ids(16, 0), ids(24, 100)...), "", 1},
		{"the first block differs: the chain differs after it", append(ids(16, 100), ids(24, 16)...), "", 0},
		{"another adapter", ids(40, 0), "sql", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tokenizer.BlockHashes(tc.ids, tc.adapter, 16)
			n := 0
			for n < min(len(got), len(base)) && got[n] == base[n] {
				n++
			}
			if n != tc.same {
				t.Errorf("%d leading hashes equal, want %d", n, tc.same)
			}
			if slices.Contains(got, 0) {
				t.Errorf("a hash is 0: %v", got)
			}
		})
	}
}
