package sim

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// CountTokens counts tokens the simulator's way: every run of letters, every
// run of digits, and every other non-space character is one token. It is
// not any model's tokenizer; it only has to be simple enough that tests can
// predict usage counts.
func CountTokens(s string) int {
	n := 0
	prev := 0 // 0 space, 1 letter, 2 digit, 3 other
	for _, r := range s {
		var class int
		switch {
		case unicode.IsSpace(r):
			class = 0
		case unicode.IsLetter(r):
			class = 1
		case unicode.IsDigit(r):
			class = 2
		default:
			class = 3
		}
		if class != 0 && (class != prev || class == 3) {
			n++
		}
		prev = class
	}
	return n
}

// RenderChat applies the simulator's chat template: each message as
// "<|role|>\n" + content + "\n", then "<|assistant|>\n" for the answer. The
// template's tokens count as prompt tokens, as a real template's do.
func RenderChat(msgs []openai.Message) (string, error) {
	return renderChat(msgs, ChatTemplate{AddGenerationPrompt: true})
}

// ChatTemplate holds vLLM's chat template switches.
type ChatTemplate struct {
	// AddGenerationPrompt ends the prompt with the assistant's header
	// (vLLM's add_generation_prompt, default true).
	AddGenerationPrompt bool
	// ContinueFinalMessage leaves the final message open, so that the
	// model goes on from it (vLLM's continue_final_message): a partial
	// assistant answer is continued, not answered.
	ContinueFinalMessage bool
}

func renderChat(msgs []openai.Message, tmpl ChatTemplate) (string, error) {
	var b strings.Builder
	for i, m := range msgs {
		text, err := m.Text()
		if err != nil {
			return "", err
		}
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>\n")
		b.WriteString(text)
		if tmpl.ContinueFinalMessage && i == len(msgs)-1 {
			return b.String(), nil
		}
		b.WriteString("\n")
	}
	if tmpl.AddGenerationPrompt {
		b.WriteString("<|assistant|>\n")
	}
	return b.String(), nil
}

// prompt is what the engine knows of a request's input: its token count and
// a digest that stands for its KV cache.
type prompt struct {
	tokens int
	digest string
	// midWord means the prompt ends in a letter or digit, as a partial
	// answer being continued does: the first output token is a new word.
	midWord bool
}

func textPrompt(s string) prompt {
	sum := sha256.Sum256([]byte(s))
	last, _ := utf8.DecodeLastRuneInString(s)
	return prompt{tokens: CountTokens(s), digest: hex.EncodeToString(sum[:12]),
		midWord: unicode.IsLetter(last) || unicode.IsDigit(last)}
}

func tokenPrompt(ids []int) prompt {
	h := sha256.New()
	var buf [8]byte
	for _, id := range ids {
		binary.LittleEndian.PutUint64(buf[:], uint64(id))
		h.Write(buf[:])
	}
	return prompt{tokens: len(ids), digest: hex.EncodeToString(h.Sum(nil)[:12])}
}

// vocabulary is what the simulated model says. Each word is one token under
// CountTokens, so generated text re-tokenizes to its completion_tokens.
var vocabulary = strings.Fields(`
	alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima
	mike november oscar papa quebec romeo sierra tango uniform victor whiskey
	xray yankee zulu amber azure coral crimson ivory jade lemon maroon ochre
	olive pearl plum ruby sage scarlet teal umber violet wheat river stone
	cloud ember frost grove harbor island meadow orbit prairie quartz ridge
	summit thunder valley willow`)

// model is the deterministic language model: given the seed and the digest
// of a KV cache (that is, of a prompt), it says the same words every time.
type model struct{ seed uint64 }

func (m model) hash(digest string, i uint64) uint64 {
	h := m.seed ^ 0x9e3779b97f4a7c15
	for _, c := range []byte(digest) {
		h = mix(h ^ uint64(c))
	}
	return mix(h ^ i)
}

// token returns output token i (0-based) for the KV cache with digest.
func (m model) token(digest string, i int) string {
	w := vocabulary[m.hash(digest, uint64(i))%uint64(len(vocabulary))]
	if i == 0 {
		return w
	}
	return " " + w
}

// naturalLength is the number of tokens the model says before its
// end-of-sequence token: 16 to 256, fixed per prompt.
func (m model) naturalLength(digest string) int {
	return 16 + int(m.hash(digest, 1<<63)%241)
}

// mix is splitmix64's finalizer.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
