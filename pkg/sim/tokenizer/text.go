package tokenizer

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/pdq-dev/pdq/pkg/openai"
)

// CountTokens counts tokens the simulator's way: every run of letters, every
// run of digits, and every other non-space character is one token. It is
// not any model's tokenizer; it only has to be simple enough that tests can
// predict usage counts. GET /tokenize gives the ids of the same tokens.
func CountTokens(s string) int {
	n := 0
	prev := 0
	for _, r := range s {
		class := charClass(r)
		if startsToken(class, prev) {
			n++
		}
		prev = class
	}
	return n
}

// RenderChat applies the simulator's chat template: each message as
// "<|role|>\n" + content + "\n", then "<|assistant|>\n" for the answer. The
// template's tokens count as prompt tokens, as a real template's do. An
// image, audio or video part shows as "<image>", "<audio>" or "<video>" on
// a line before the message's text, as vLLM puts a model's placeholders;
// it counts as Config.MMTokens tokens, not as the placeholder's text.
func RenderChat(msgs []openai.Message) (string, error) {
	r, err := Render(msgs, ChatTemplate{AddGenerationPrompt: true})
	return r.String(), err
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

// Rendered is a chat prompt after the template: text, with media items
// where their placeholders go.
type Rendered struct{ Segs []segment }

// segment is a piece of text, or one media item.
type segment struct {
	Text  string
	Media *mediaItem
}

// mediaItem is an image, audio or video part, known by a hash of its
// content (its URL or data, or the uuid the client gave it).
type mediaItem struct {
	modality int
	hash     uint64
}

func (r *Rendered) add(text string) {
	if text != "" {
		r.Segs = append(r.Segs, segment{Text: text})
	}
}

// String is the prompt with each media item as its placeholder.
func (r Rendered) String() string {
	var b strings.Builder
	for _, s := range r.Segs {
		if s.Media != nil {
			b.WriteString(modalityPlaceholder[s.Media.modality])
		} else {
			b.WriteString(s.Text)
		}
	}
	return b.String()
}

// ids tokenizes the prompt; each media item is mmTokens ids.
func (r Rendered) IDs(mmTokens int) []int {
	var ids []int
	for _, s := range r.Segs {
		if s.Media != nil {
			ids = append(ids, mediaIDs(s.Media.modality, s.Media.hash, mmTokens)...)
		} else {
			ids = append(ids, TextIDs(s.Text)...)
		}
	}
	return ids
}

// MidWord reports whether the prompt ends in a letter or digit.
func (r Rendered) MidWord() bool {
	if n := len(r.Segs); n > 0 && r.Segs[n-1].Media == nil {
		return EndsMidWord(r.Segs[n-1].Text)
	}
	return false
}

// textParts are the text-like part types and the key of their text.
var textParts = map[string]string{"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}

// mediaParts are the media part types vLLM reads, their modality and the
// key of their content.
var mediaParts = map[string]struct {
	modality int
	key      string
}{
	"image_url":    {modalityImage, "image_url"},
	"input_image":  {modalityImage, "image_url"},
	"image_embeds": {modalityImage, "image_embeds"},
	"image_pil":    {modalityImage, "image_pil"},
	"audio_url":    {modalityAudio, "audio_url"},
	"input_audio":  {modalityAudio, "input_audio"},
	"audio_embeds": {modalityAudio, "audio_embeds"},
	"video_url":    {modalityVideo, "video_url"},
	"video_embeds": {modalityVideo, "video_embeds"},
}

// readMedia reads one media part's identity.
func readMedia(p openai.Part) (*mediaItem, error) {
	kind := mediaParts[p.Type]
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(p.Raw, &fields); err != nil {
		return nil, fmt.Errorf("invalid %s part: %v", p.Type, err)
	}
	isNull := func(raw json.RawMessage) bool {
		raw = bytes.TrimSpace(raw)
		return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d\x00", kind.modality)
	switch v := fields[kind.key]; {
	case !isNull(fields["uuid"]):
		h.Write([]byte("uuid\x00"))
		h.Write(bytes.TrimSpace(fields["uuid"]))
	case isNull(v):
		return nil, fmt.Errorf("invalid %s part: '%s' is required", p.Type, kind.key)
	case strings.HasSuffix(kind.key, "_url"):
		var url struct {
			URL *string `json:"url"`
		}
		var s string
		switch {
		case json.Unmarshal(v, &s) == nil:
		case json.Unmarshal(v, &url) == nil && url.URL != nil:
			s = *url.URL
		default:
			return nil, fmt.Errorf("invalid %s part: '%s.url' must be a string", p.Type, kind.key)
		}
		h.Write([]byte(s))
	default:
		var c bytes.Buffer
		if err := json.Compact(&c, v); err != nil {
			return nil, fmt.Errorf("invalid %s part: %v", p.Type, err)
		}
		h.Write(c.Bytes())
	}
	return &mediaItem{modality: kind.modality, hash: h.Sum64()}, nil
}

// Render applies the template. Text parts of a message are joined by
// newlines; its media items go first, one per line, as vLLM's
// _get_full_multimodal_text_prompt puts a model's placeholders. An unknown
// part type is vLLM's error.
func Render(msgs []openai.Message, tmpl ChatTemplate) (Rendered, error) {
	var r Rendered
	var pending strings.Builder // text not yet added
	for i, m := range msgs {
		parts, err := m.Parts()
		if err != nil {
			return Rendered{}, fmt.Errorf("messages[%d].content: %w", i, err)
		}
		var texts []string
		var media []*mediaItem
		for _, p := range parts {
			if key, ok := textParts[p.Type]; ok {
				if p.Type == "text" {
					texts = append(texts, p.Text)
					continue
				}
				var f map[string]*string
				if json.Unmarshal(p.Raw, &f) == nil && f[key] != nil {
					texts = append(texts, *f[key])
				}
				continue
			}
			if _, ok := mediaParts[p.Type]; !ok {
				//lint:ignore ST1005 vLLM's own message, which clients see
				return Rendered{}, fmt.Errorf("Unknown part type: %s", p.Type)
			}
			item, err := readMedia(p)
			if err != nil {
				return Rendered{}, err
			}
			media = append(media, item)
		}
		pending.WriteString("<|")
		pending.WriteString(m.Role)
		pending.WriteString("|>\n")
		for _, item := range media {
			r.add(pending.String())
			pending.Reset()
			r.Segs = append(r.Segs, segment{Media: item})
			pending.WriteString("\n")
		}
		pending.WriteString(strings.Join(texts, "\n"))
		if tmpl.ContinueFinalMessage && i == len(msgs)-1 {
			r.add(pending.String())
			return r, nil
		}
		pending.WriteString("\n")
	}
	if tmpl.AddGenerationPrompt {
		pending.WriteString("<|assistant|>\n")
	}
	r.add(pending.String())
	return r, nil
}

// Prompt is what the engine knows of a request's input: its token count and
// a digest that stands for its KV cache.
type Prompt struct {
	Tokens int
	Digest string
	// MidWord means the prompt ends in a letter or digit, as a partial
	// answer being continued does: the first output token is a new word.
	MidWord bool
}

// PromptOf is the prompt of token ids run under a LoRA adapter ("" for the
// base model). The digest covers both, since KV caches differ per adapter.
func PromptOf(ids []int, adapter string, midWord bool) Prompt {
	h := sha256.New()
	if adapter != "" {
		h.Write([]byte("lora\x00" + adapter + "\x00"))
	}
	var buf [8]byte
	for _, id := range ids {
		binary.LittleEndian.PutUint64(buf[:], uint64(id))
		h.Write(buf[:])
	}
	return Prompt{Tokens: len(ids), Digest: hex.EncodeToString(h.Sum(nil)[:12]), MidWord: midWord}
}

func EndsMidWord(s string) bool {
	last, _ := utf8.DecodeLastRuneInString(s)
	return unicode.IsLetter(last) || unicode.IsDigit(last)
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

// Model is the deterministic language model: given the seed and the digest
// of a KV cache (that is, of a prompt), it says the same words every time.
type Model struct{ Seed uint64 }

func (m Model) Hash(digest string, i uint64) uint64 {
	h := m.Seed ^ 0x9e3779b97f4a7c15
	for _, c := range []byte(digest) {
		h = Mix(h ^ uint64(c))
	}
	return Mix(h ^ i)
}

// Token returns output token i (0-based) for the KV cache with digest.
func (m Model) Token(digest string, i int) string {
	w := vocabulary[m.Hash(digest, uint64(i))%uint64(len(vocabulary))]
	if i == 0 {
		return w
	}
	return " " + w
}

// NaturalLength is the number of tokens the model says before its
// end-of-sequence token: 16 to 256, fixed per prompt.
func (m Model) NaturalLength(digest string) int {
	return 16 + int(m.Hash(digest, 1<<63)%241)
}

// Embed is the embedding of the prompt with digest, as an embedding
// model's pooled output: the unit vector of dim hashed values in [-1, 1),
// normalized, the same every time.
func (m Model) Embed(digest string, dim int) []float32 {
	raw := make([]float64, dim)
	var norm float64
	for k := range raw {
		raw[k] = float64(m.Hash(digest, uint64(k)+1<<62)>>11)/(1<<52) - 1
		norm += raw[k] * raw[k]
	}
	norm = math.Sqrt(norm)
	vec := make([]float32, dim)
	for k, x := range raw {
		vec[k] = float32(x / norm)
	}
	return vec
}

// Mix is splitmix64's finalizer.
func Mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
