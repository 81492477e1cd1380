package bench

import (
	"errors"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

func TestVocabularyIsOneTokenPerWord(t *testing.T) {
	for _, w := range vocabulary {
		if strings.IndexFunc(w, func(r rune) bool { return !unicode.IsLetter(r) }) >= 0 {
			t.Errorf("word %q is not letters only", w)
		}
	}
	if len(vocabulary) < 200 {
		t.Errorf("vocabulary has %d words", len(vocabulary))
	}
}

func TestRandomDataset(t *testing.T) {
	tests := []struct {
		name         string
		ds           RandomDataset
		inLo, inHi   int // prompt length bounds, prefix included
		outLo, outHi int
	}{
		{"fixed lengths", RandomDataset{InputLen: 32, OutputLen: 8}, 32, 32, 8, 8},
		{"range ratio", RandomDataset{InputLen: 100, OutputLen: 10, RangeRatio: 0.5}, 50, 150, 5, 15},
		{"prefix", RandomDataset{InputLen: 10, OutputLen: 4, PrefixLen: 6}, 16, 16, 4, 4},
		{"output at least 1", RandomDataset{InputLen: 20, OutputLen: 1, RangeRatio: 0.9}, 1, 38, 1, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reqs, err := tt.ds.Sample(200, "bench-x-")
			if err != nil {
				t.Fatal(err)
			}
			var ins, outs []int
			for i, r := range reqs {
				if got := tokenizer.CountTokens(r.Prompt); got != r.PromptLen {
					t.Fatalf("request %d: pdq sim counts %d tokens, dataset says %d", i, got, r.PromptLen)
				}
				if r.RequestID != "bench-x-"+strconv.Itoa(i) {
					t.Fatalf("request %d has id %q", i, r.RequestID)
				}
				ins, outs = append(ins, r.PromptLen), append(outs, r.OutputLen)
			}
			if slices.Min(ins) < tt.inLo || slices.Max(ins) > tt.inHi {
				t.Errorf("prompt lengths in [%d, %d], want within [%d, %d]", slices.Min(ins), slices.Max(ins), tt.inLo, tt.inHi)
			}
			if slices.Min(outs) < tt.outLo || slices.Max(outs) > tt.outHi {
				t.Errorf("output lengths in [%d, %d], want within [%d, %d]", slices.Min(outs), slices.Max(outs), tt.outLo, tt.outHi)
			}
			if tt.ds.RangeRatio > 0 && slices.Min(ins) == slices.Max(ins) {
				t.Errorf("range ratio %v gave one length", tt.ds.RangeRatio)
			}
			if tt.ds.PrefixLen > 0 {
				pre := strings.Fields(reqs[0].Prompt)[:tt.ds.PrefixLen]
				for _, r := range reqs {
					if !slices.Equal(strings.Fields(r.Prompt)[:tt.ds.PrefixLen], pre) {
						t.Fatalf("prompts do not share the prefix")
					}
				}
			}
		})
	}
}

func TestRandomDatasetSeeded(t *testing.T) {
	a, _ := RandomDataset{InputLen: 20, OutputLen: 5, RangeRatio: 0.5, Seed: 3}.Sample(10, "")
	b, _ := RandomDataset{InputLen: 20, OutputLen: 5, RangeRatio: 0.5, Seed: 3}.Sample(10, "")
	c, _ := RandomDataset{InputLen: 20, OutputLen: 5, RangeRatio: 0.5, Seed: 4}.Sample(10, "")
	if !reflect.DeepEqual(a, b) {
		t.Error("one seed gave two datasets")
	}
	if reflect.DeepEqual(a, c) {
		t.Error("two seeds gave one dataset")
	}
}

func TestRandomDatasetInvalid(t *testing.T) {
	for _, ds := range []RandomDataset{
		{InputLen: 10, OutputLen: 1, RangeRatio: 1},
		{InputLen: 10, OutputLen: 1, RangeRatio: -0.1},
		{InputLen: 0, OutputLen: 1},
		{InputLen: 1, OutputLen: 1, RangeRatio: 0.5},
	} {
		if _, err := ds.Sample(1, ""); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: err %v, want ErrInvalid", ds, err)
		}
	}
}
