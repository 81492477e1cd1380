package jsonobj

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// ErrInvalid is wrapped by every error about the document being edited or
// read: it is not valid JSON, or not an object (or array) where one is
// expected.
var ErrInvalid = errors.New("jsonobj: invalid JSON")

// maxDepth is encoding/json's nesting limit: it rejects deeper documents,
// and so does this package.
const maxDepth = 10000

func syntaxError(s []byte, i int, what string) error {
	if i >= len(s) {
		return fmt.Errorf("%w: unexpected end of input, %s", ErrInvalid, what)
	}
	return fmt.Errorf("%w: %s at offset %d, found %q", ErrInvalid, what, i, s[i])
}

// at returns s[i], or 0 past the end: 0 is no valid byte at any place
// where at is used, so the end of input fails as a wrong byte would.
func at(s []byte, i int) byte {
	if i < len(s) {
		return s[i]
	}
	return 0
}

func skipSpace(s []byte, i int) int {
	for i < len(s) {
		switch s[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// strSafe marks the bytes a string may hold as they are: all but the
// quote, the backslash and control characters.
var strSafe = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// ctlOrBackslash is nonzero if and only if a byte of x is a control
// character or a backslash. (x - lsb*0x20) &^ x has a byte's high bit set
// for each byte below 0x20, and maybe for bytes above one, where a borrow
// ran on: exact as to whether there is one, not as to which. The same
// test of x^(lsb*'\\') against 1 finds a zero byte, a backslash in x.
func ctlOrBackslash(x uint64) uint64 {
	b := x ^ (lsb * '\\')
	return ((x-lsb*0x20)&^x | (b-lsb)&^b) & msb
}

// special reports whether any byte of x is a quote, a backslash or a
// control character (exact as a yes/no, not as to which byte).
func special(x uint64) bool {
	q := x ^ (lsb * '"')
	return ctlOrBackslash(x)|(q-lsb)&^q&msb != 0
}

// longRun is how many plain bytes in a row make skipString take a string
// for a long stretch of text, such as a prompt. Code, and text whose
// non-ASCII characters are escaped, have shorter runs between escapes;
// plain prose and pdq bench's prompts, longer.
const longRun = 64

// skipString returns the end of the string that starts with the quote at
// s[i].
//
// It reads a run of plain bytes 8 at a time. A run of longRun bytes is
// read on with bytes.IndexByte, which is vectorized, for the next quote,
// and plainLen, 32 bytes a step, for a backslash or a control character
// before it; until a run shorter than that step says escapes are dense
// again. A request's body is walked several times on its way to the
// engines: a long prompt of plain text goes by faster this way, while
// strings dense with escapes pay a little for the count of the run
// (BenchmarkGet; the figures are in docs/benchmarks.md). The next quote, q, is
// kept from one run to the next, so that no byte is searched for a quote
// twice however the runs alternate.
func skipString(s []byte, i int) (int, error) {
	i++
	q := -1 // the first quote at or after i once looked for, or len(s) if none
	long := false
	for {
		if long {
			if q < i {
				if q = bytes.IndexByte(s[i:], '"'); q < 0 {
					q = len(s)
				} else {
					q += i
				}
			}
			n := plainLen(s[i:q])
			i += n
			long = n >= 32
		} else {
			run := i
			for i+8 <= len(s) && !special(binary.LittleEndian.Uint64(s[i:])) {
				if i += 8; i-run >= longRun {
					long = true
					break
				}
			}
			if long {
				continue
			}
			for i < len(s) && strSafe[s[i]] {
				i++
			}
		}
		switch c := at(s, i); {
		case i >= len(s):
			return i, syntaxError(s, i, "unterminated string")
		case c == '"':
			return i + 1, nil
		case c == '\\':
			switch at(s, i+1) {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if hex4(s, i+2) < 0 {
					return i, syntaxError(s, i, `invalid \u escape`)
				}
				i += 6
			default:
				return i, syntaxError(s, i+1, "invalid escape")
			}
		default:
			return i, syntaxError(s, i, "control character in string")
		}
	}
}

// plainLen returns how many bytes at the start of s are neither a
// backslash nor a control character.
func plainLen(s []byte) int {
	n := len(s)
	for len(s) >= 32 {
		a := binary.LittleEndian.Uint64(s[0:8])
		b := binary.LittleEndian.Uint64(s[8:16])
		c := binary.LittleEndian.Uint64(s[16:24])
		d := binary.LittleEndian.Uint64(s[24:32])
		if ctlOrBackslash(a)|ctlOrBackslash(b)|ctlOrBackslash(c)|ctlOrBackslash(d) != 0 {
			break
		}
		s = s[32:]
	}
	for len(s) > 0 && s[0] >= 0x20 && s[0] != '\\' {
		s = s[1:]
	}
	return n - len(s)
}

// hexValue is the value of a hex digit, or -1.
var hexValue = func() (t [256]int8) {
	for c := range t {
		switch {
		case '0' <= c && c <= '9':
			t[c] = int8(c - '0')
		case 'a' <= c && c <= 'f':
			t[c] = int8(c - 'a' + 10)
		case 'A' <= c && c <= 'F':
			t[c] = int8(c - 'A' + 10)
		default:
			t[c] = -1
		}
	}
	return t
}()

// hex4 reads the four hex digits at s[i:], or returns -1.
func hex4(s []byte, i int) rune {
	if i < 0 || i+4 > len(s) {
		return -1
	}
	a, b, c, d := hexValue[s[i]], hexValue[s[i+1]], hexValue[s[i+2]], hexValue[s[i+3]]
	if a|b|c|d < 0 {
		return -1
	}
	return rune(a)<<12 | rune(b)<<8 | rune(c)<<4 | rune(d)
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// skipNumber returns the end of the number at s[i]: RFC 8259's grammar,
// as encoding/json checks it.
func skipNumber(s []byte, i int) (int, error) {
	if at(s, i) == '-' {
		i++
	}
	switch c := at(s, i); {
	case c == '0':
		i++
	case '1' <= c && c <= '9':
		for isDigit(at(s, i)) {
			i++
		}
	default:
		return i, syntaxError(s, i, "invalid number")
	}
	if at(s, i) == '.' {
		i++
		if !isDigit(at(s, i)) {
			return i, syntaxError(s, i, "invalid number")
		}
		for isDigit(at(s, i)) {
			i++
		}
	}
	if c := at(s, i); c == 'e' || c == 'E' {
		i++
		if c := at(s, i); c == '+' || c == '-' {
			i++
		}
		if !isDigit(at(s, i)) {
			return i, syntaxError(s, i, "invalid number")
		}
		for isDigit(at(s, i)) {
			i++
		}
	}
	return i, nil
}

// skipScalar returns the end of the string, number or literal at s[i].
func skipScalar(s []byte, i int) (int, error) {
	lit := ""
	switch c := at(s, i); c {
	case '"':
		return skipString(s, i)
	case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
		return skipNumber(s, i)
	case 't':
		lit = "true"
	case 'f':
		lit = "false"
	case 'n':
		lit = "null"
	default:
		return i, syntaxError(s, i, "value expected")
	}
	if len(s)-i < len(lit) || string(s[i:i+len(lit)]) != lit {
		return i, syntaxError(s, i, "invalid literal")
	}
	return i + len(lit), nil
}

// skipValue returns the end of the value at s[i]; depth is the number of
// arrays and objects around it.
func skipValue(s []byte, i, depth int) (int, error) {
	if c := at(s, i); c == '{' || c == '[' {
		return skipNested(s, i, depth)
	}
	return skipScalar(s, i)
}

// skipMemberKey reads `"key" :` at s[i] and returns where the value
// starts.
func skipMemberKey(s []byte, i int) (int, error) {
	if at(s, i) != '"' {
		return i, syntaxError(s, i, "object key expected")
	}
	i, err := skipString(s, i)
	if err != nil {
		return i, err
	}
	i = skipSpace(s, i)
	if at(s, i) != ':' {
		return i, syntaxError(s, i, "':' expected")
	}
	return skipSpace(s, i+1), nil
}

// skipNested returns the end of the object or array at s[i] without
// recursion: a bit a level says whether it is an object.
func skipNested(s []byte, i, depth int) (int, error) {
	var small [4]uint64
	objects := small[:]
	n := 0 // levels open
	var err error
	for {
		// s[i] starts a value.
		if c := at(s, i); c == '{' || c == '[' {
			if depth+n+1 > maxDepth {
				return i, syntaxError(s, i, "nesting deeper than 10000")
			}
			if n/64 == len(objects) {
				objects = append(objects, 0)
			}
			if c == '{' {
				objects[n/64] |= 1 << (n % 64)
			} else {
				objects[n/64] &^= 1 << (n % 64)
			}
			n++
			i = skipSpace(s, i+1)
			switch {
			case c == '{' && at(s, i) == '}', c == '[' && at(s, i) == ']':
				i++
				n--
			case c == '{':
				if i, err = skipMemberKey(s, i); err != nil {
					return i, err
				}
				continue
			default:
				continue
			}
		} else if i, err = skipScalar(s, i); err != nil {
			return i, err
		}
		// A value ended: close what it ends, up to the next value.
		for {
			if n == 0 {
				return i, nil
			}
			i = skipSpace(s, i)
			object := objects[(n-1)/64]&(1<<((n-1)%64)) != 0
			c := at(s, i)
			if c == ',' {
				i = skipSpace(s, i+1)
				if object {
					if i, err = skipMemberKey(s, i); err != nil {
						return i, err
					}
				}
				break
			}
			if object && c == '}' || !object && c == ']' {
				i++
				n--
				continue
			}
			return i, syntaxError(s, i, "',' or end of object or array expected")
		}
	}
}

// validValue reports whether v is one JSON value, with no more than
// whitespace around it.
func validValue(v []byte) bool {
	i := skipSpace(v, 0)
	i, err := skipValue(v, i, 1)
	return err == nil && skipSpace(v, i) == len(v)
}

// nextRune decodes the rune at raw[i:] of a valid string's contents, as
// encoding/json does: invalid UTF-8 and lone surrogates become U+FFFD.
func nextRune(raw []byte, i int) (rune, int) {
	c := raw[i]
	if c != '\\' {
		if c < utf8.RuneSelf {
			return rune(c), i + 1
		}
		r, size := utf8.DecodeRune(raw[i:])
		return r, i + size
	}
	switch raw[i+1] {
	case 'b':
		return '\b', i + 2
	case 'f':
		return '\f', i + 2
	case 'n':
		return '\n', i + 2
	case 'r':
		return '\r', i + 2
	case 't':
		return '\t', i + 2
	case 'u':
		r := hex4(raw, i+2)
		i += 6
		if utf16.IsSurrogate(r) {
			r2 := rune(-1)
			if at(raw, i) == '\\' && at(raw, i+1) == 'u' {
				r2 = hex4(raw, i+2)
			}
			if d := utf16.DecodeRune(r, r2); d != unicode.ReplacementChar {
				return d, i + 6
			}
			return unicode.ReplacementChar, i
		}
		return r, i
	default: // '"', '\\', '/'
		return rune(raw[i+1]), i + 2
	}
}

// plain reports whether a string's contents are ASCII without escapes:
// then its bytes are its value.
func plain(raw []byte) bool {
	for _, c := range raw {
		if c >= utf8.RuneSelf || c == '\\' {
			return false
		}
	}
	return true
}

// keyIs reports whether the contents raw of a valid JSON string decode to
// key; with fold, to key in any letter case as [strings.EqualFold] (and so
// encoding/json, for struct fields) has it. isPlain is plain(raw).
func keyIs(raw []byte, isPlain bool, key string, fold bool) bool {
	if isPlain && !fold {
		return string(raw) == key
	}
	i, j := 0, 0
	for i < len(raw) && j < len(key) {
		r, ni := nextRune(raw, i)
		t, size := utf8.DecodeRuneInString(key[j:])
		i, j = ni, j+size
		if r == t {
			continue
		}
		if !fold || !foldEqual(r, t) {
			return false
		}
	}
	return i == len(raw) && j == len(key)
}

// foldEqual is the rune comparison of strings.EqualFold.
func foldEqual(sr, tr rune) bool {
	if tr < sr {
		tr, sr = sr, tr
	}
	if tr < utf8.RuneSelf {
		return 'A' <= sr && sr <= 'Z' && tr == sr+'a'-'A'
	}
	r := unicode.SimpleFold(sr)
	for r != sr && r < tr {
		r = unicode.SimpleFold(r)
	}
	return r == tr
}
