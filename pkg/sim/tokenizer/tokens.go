package tokenizer

import (
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"
)

// The simulator's token ids. A token is what CountTokens counts (a run of
// letters, a run of digits, or one other character) together with the
// whitespace before it, so that the tokens of a text joined give back the
// text, less any trailing whitespace. Ids are a pure function of the token,
// the same on every engine:
//
//   - 0 to 999 are reserved (special tokens), decoded as "<|reserved_N|>";
//   - the model's own words, bare and after a space, are 1000 and up;
//   - a token of at most 6 bytes is packedBase plus its bytes, big-endian;
//   - a longer token is hashedBase plus a 49-bit hash of it, decoded from a
//     table of the long tokens seen (and the model's words);
//   - an image, audio or video part is MMTokens ids from mmBase up, made
//     from a hash of its content.
//
// Every id stays below 2^53, so that JSON clients that read numbers as
// doubles keep them exact.
const (
	reservedIDs = 1000
	vocabBase   = 1000
	packedBase  = 1 << 20
	packedMax   = 6
	hashedBase  = 1 << 49
	hashedMask  = 1<<49 - 1
	mmBase      = 1 << 51
	mmHashMask  = 1<<47 - 1
)

// Media modalities, as they appear in mm token ids.
const (
	modalityImage = 1
	modalityAudio = 2
	modalityVideo = 3
)

var modalityPlaceholder = map[int]string{modalityImage: "<image>", modalityAudio: "<audio>", modalityVideo: "<video>"}

// vocabIDs maps the model's words, bare and after a space, to their ids.
var vocabIDs = func() map[string]int {
	m := make(map[string]int, 2*len(vocabulary))
	for i, w := range vocabulary {
		m[w] = vocabBase + 2*i
		m[" "+w] = vocabBase + 2*i + 1
	}
	return m
}()

// longTokens decodes hashed ids: the long tokens /tokenize has handed
// out (see RememberLongTokens). It is bounded; when full it starts again.
var longTokens = struct {
	sync.Mutex
	m map[int]string
}{m: map[int]string{}}

const longTokensMax = 1 << 17

// charClass is a rune's class under CountTokens: 0 space, 1 letter,
// 2 digit, 3 anything else.
func charClass(r rune) int {
	switch {
	case unicode.IsSpace(r):
		return 0
	case unicode.IsLetter(r):
		return 1
	case unicode.IsDigit(r):
		return 2
	}
	return 3
}

// splitTokens cuts s into tokens, each with the whitespace before it;
// trailing whitespace is dropped. len(splitTokens(s)) == CountTokens(s).
func splitTokens(s string) []string {
	var out []string
	cur, inRun, prev := 0, false, 0
	for i, r := range s {
		class := charClass(r)
		switch {
		case startsToken(class, prev):
			if inRun {
				out = append(out, s[cur:i])
				cur = i
			}
			inRun = true
		case class == 0 && inRun:
			out = append(out, s[cur:i])
			cur, inRun = i, false
		}
		prev = class
	}
	if inRun {
		out = append(out, s[cur:])
	}
	return out
}

// startsToken reports whether a character of class starts a token after
// one of class prev: the one rule that CountTokens and splitTokens share.
func startsToken(class, prev int) bool {
	return class != 0 && (class != prev || class == 3)
}

// tokenID is the id of one token.
func tokenID(tok string) int {
	if id, ok := vocabIDs[tok]; ok {
		return id
	}
	if len(tok) <= packedMax {
		v := 0
		for i := 0; i < len(tok); i++ {
			v = v<<8 | int(tok[i])
		}
		return packedBase + v
	}
	h := fnv.New64a()
	h.Write([]byte(tok))
	return hashedBase + int(h.Sum64()&hashedMask)
}

// RememberLongTokens keeps the hashed tokens of s in longTokens, so that
// /detokenize decodes the ids /tokenize gives them. Only /tokenize calls
// it: generation needs no table, nor a lock per long token.
func RememberLongTokens(s string) {
	longTokens.Lock()
	defer longTokens.Unlock()
	for _, tok := range splitTokens(s) {
		if id := tokenID(tok); id >= hashedBase && id <= hashedBase+hashedMask {
			if len(longTokens.m) >= longTokensMax {
				longTokens.m = map[int]string{}
			}
			longTokens.m[id] = tok
		}
	}
}

// TextIDs tokenizes a text.
func TextIDs(s string) []int {
	toks := splitTokens(s)
	ids := make([]int, len(toks))
	for i, t := range toks {
		ids[i] = tokenID(t)
	}
	return ids
}

// mediaIDs are the n token ids of one media item of a modality whose
// content hashes to h. The first of them decodes to the modality's
// placeholder on a line of its own (the template always puts a media item
// after a newline, which the text before it then loses as trailing
// whitespace), the others to nothing.
func mediaIDs(modality int, h uint64, n int) []int {
	ids := make([]int, n)
	for i := range ids {
		first := 0
		if i == 0 {
			first = 1
		}
		ids[i] = mmBase | modality<<48 | first<<47 | int((h+uint64(i))&mmHashMask)
	}
	return ids
}

// TokenString decodes one id, or says why it cannot.
func TokenString(id int) (string, error) {
	switch {
	case id < 0:
		return "", fmt.Errorf("token id %d is negative", id)
	case id < reservedIDs:
		return fmt.Sprintf("<|reserved_%d|>", id), nil
	case id < vocabBase+2*len(vocabulary):
		k := id - vocabBase
		if k%2 == 1 {
			return " " + vocabulary[k/2], nil
		}
		return vocabulary[k/2], nil
	case id >= packedBase && id < packedBase+1<<(8*packedMax):
		v := id - packedBase
		if v == 0 {
			return "\x00", nil
		}
		var b []byte
		for ; v > 0; v >>= 8 {
			b = append(b, byte(v))
		}
		for i, j := 0, len(b)-1; i < j; i, j = i+1, j-1 {
			b[i], b[j] = b[j], b[i]
		}
		// Only the id tokenize gives a token is one: valid UTF-8, one
		// token, and not a word of the model's (those have their own ids).
		if tok := string(b); utf8.ValidString(tok) && tokenID(tok) == id {
			if toks := splitTokens(tok); len(toks) == 1 && toks[0] == tok {
				return tok, nil
			}
		}
	case id >= hashedBase && id <= hashedBase+hashedMask:
		longTokens.Lock()
		tok, ok := longTokens.m[id]
		longTokens.Unlock()
		if ok {
			return tok, nil
		}
	case id >= mmBase && id < mmBase+4<<48:
		if m := id >> 48 & 3; m != 0 {
			if id>>47&1 == 1 {
				return "\n" + modalityPlaceholder[m], nil
			}
			return "", nil
		}
	}
	// vLLM's own message, which clients see.
	return "", fmt.Errorf("Token id %d is out of vocabulary", id)
}

// DecodeIDs joins the text of ids.
func DecodeIDs(ids []int) (string, error) {
	var b strings.Builder
	for _, id := range ids {
		s, err := TokenString(id)
		if err != nil {
			return "", err
		}
		b.WriteString(s)
	}
	return b.String(), nil
}
