package tokenizer

import (
	"slices"
	"strings"
	"testing"
)

func TestTokenIDs(t *testing.T) {
	for _, s := range []string{
		"", "   ", "hello", "hello world", "hello, world!", "abc123", "x...", "<|user|>\nHi\n<|assistant|>\n",
		"héllo wörld", "日本語 テキスト", " alpha bravo", "supercalifragilistic  expialidocious\t42",
		"tabs\tand\nnewlines\r\n", "trailing space  ", "\x00nul", "emoji 🙂🙂 ok", "  leading",
		strings.Repeat("long ", 50) + "end",
	} {
		ids := TextIDs(s)
		RememberLongTokens(s) // as /tokenize does, for /detokenize
		if len(ids) != CountTokens(s) {
			t.Errorf("%q: %d ids, CountTokens %d", s, len(ids), CountTokens(s))
		}
		for _, id := range ids {
			if id < 0 || id >= 1<<53 {
				t.Errorf("%q: id %d is not JSON-safe", s, id)
			}
		}
		got, err := DecodeIDs(ids)
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		if want := strings.TrimRightFunc(s, isSpaceRune); got != want {
			t.Errorf("decode(encode(%q)) = %q, want %q", s, got, want)
		}
	}
	// The model's words have small ids, and its output re-tokenizes to as
	// many tokens as it said.
	if id := tokenID(" thunder"); id < vocabBase || id >= vocabBase+2*len(vocabulary) {
		t.Errorf(`" thunder" = %d, not a vocabulary id`, id)
	}
	if got, _ := DecodeIDs([]int{1, 2}); got != "<|reserved_1|><|reserved_2|>" {
		t.Errorf("reserved ids decode to %q", got)
	}
	for _, id := range []int{-1, vocabBase + 2*len(vocabulary), hashedBase + 12345, 1 << 60, packedBase + 1<<40, packedBase + 0x6120} {
		if _, err := DecodeIDs([]int{id}); err == nil {
			t.Errorf("id %d: err = %v", id, err)
		}
	}
}

func isSpaceRune(r rune) bool { return charClass(r) == 0 }

func TestMediaIDs(t *testing.T) {
	ids := mediaIDs(modalityImage, 42, 4)
	if len(ids) != 4 {
		t.Fatalf("%d ids", len(ids))
	}
	text, err := DecodeIDs(ids)
	if err != nil || text != "\n<image>" {
		t.Errorf("image ids decode to %q, %v", text, err)
	}
	if slices.Equal(ids, mediaIDs(modalityImage, 43, 4)) || slices.Equal(ids, mediaIDs(modalityAudio, 42, 4)) {
		t.Error("media ids do not depend on content and modality")
	}
	for _, id := range ids {
		if id >= 1<<53 {
			t.Errorf("id %d is not JSON-safe", id)
		}
	}
}
