package tokenizer

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/pkg/openai"
)

func TestCountTokens(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{"", 0},
		{"   ", 0},
		{"hello", 1},
		{"hello world", 2},
		{"hello, world!", 4},
		{"abc123", 2},
		{"x...", 4},
		{"<|user|>\n", 5},
		{"héllo wörld", 2},
		{"日本語", 1},
		{" alpha bravo", 2},
	} {
		if got := CountTokens(tc.in); got != tc.want {
			t.Errorf("CountTokens(%q) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

func TestRenderChat(t *testing.T) {
	got, err := RenderChat([]openai.Message{
		{Role: "system", Content: json.RawMessage(`"Be brief."`)},
		{Role: "user", Content: json.RawMessage(`[{"type":"text","text":"Hi"}]`)},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
	if got != want {
		t.Errorf("RenderChat = %q, want %q", got, want)
	}
}

// A continued answer is the original prompt plus the partial answer, token
// for token: what a migrated decode relies on to count usage.
func TestRenderChatContinued(t *testing.T) {
	user := openai.Message{Role: "user", Content: json.RawMessage(`"Hi"`)}
	first, _ := RenderChat([]openai.Message{user})
	partial := " alpha bravo charlie"
	r, err := Render([]openai.Message{user, {Role: "assistant", Content: json.RawMessage(`"` + partial + `"`)}},
		ChatTemplate{ContinueFinalMessage: true})
	if err != nil {
		t.Fatal(err)
	}
	cont := r.String()
	if cont != first+partial {
		t.Errorf("continued = %q, want %q", cont, first+partial)
	}
	if CountTokens(cont) != CountTokens(first)+CountTokens(partial) {
		t.Errorf("continued prompt has %d tokens, want %d + %d", CountTokens(cont), CountTokens(first), CountTokens(partial))
	}
}

func TestModel(t *testing.T) {
	m := Model{Seed: 7}
	d := textPrompt("a prompt").Digest
	var text strings.Builder
	for i := range 50 {
		text.WriteString(m.Token(d, i))
	}
	if CountTokens(text.String()) != 50 {
		t.Errorf("50 tokens re-tokenize to %d: %q", CountTokens(text.String()), text.String())
	}
	if strings.HasPrefix(text.String(), " ") {
		t.Error("the first token starts with a space")
	}
	again := Model{Seed: 7}
	other := Model{Seed: 8}
	if again.Token(d, 3) != m.Token(d, 3) || other.Token(d, 0)+other.Token(d, 1)+other.Token(d, 2) == m.Token(d, 0)+m.Token(d, 1)+m.Token(d, 2) {
		t.Error("tokens are not a function of seed, digest and index")
	}
	for _, p := range []string{"a", "b", "c", "d", "e"} {
		if n := m.NaturalLength(textPrompt(p).Digest); n < 16 || n > 256 {
			t.Errorf("natural length %d outside 16..256", n)
		}
	}
	if textPrompt("x").Digest == tokenPrompt([]int{1}).Digest || tokenPrompt([]int{1, 2}).Digest == tokenPrompt([]int{2, 1}).Digest {
		t.Error("digests collide")
	}
}

func textPrompt(s string) Prompt { return PromptOf(TextIDs(s), "", EndsMidWord(s)) }

func tokenPrompt(ids []int) Prompt { return PromptOf(ids, "", false) }
