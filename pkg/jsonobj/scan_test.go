package jsonobj

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// refSkipString is skipString a byte at a time, as RFC 8259 reads a
// string: what the word-at-a-time loops must agree with.
func refSkipString(s []byte, i int) (int, error) {
	for i++; ; i++ {
		switch c := at(s, i); {
		case i >= len(s):
			return i, syntaxError(s, i, "unterminated string")
		case c == '"':
			return i + 1, nil
		case c < 0x20:
			return i, syntaxError(s, i, "control character in string")
		case c == '\\':
			switch at(s, i+1) {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i++
			case 'u':
				if hex4(s, i+2) < 0 {
					return i, syntaxError(s, i, `invalid \u escape`)
				}
				i += 5
			default:
				return i, syntaxError(s, i+1, "invalid escape")
			}
		}
	}
}

// TestSkipStringLong puts each kind of byte that stops a run of plain
// ones at every offset of a long string, before and after skipString
// takes the run for a long one; and then, after an escaped quote, each
// kind again a little further on: skipString looks past the quote it
// found to the next. Each string is also cut off at its end.
func TestSkipStringLong(t *testing.T) {
	stops := []string{
		`"`, `\"`, `\\`, `\/`, `\n`, `\u0041`, `\u00e9`, `\"\"`, `\\"`, `\`, `\u00`,
		`\u12`, `\x`, "\x00", "\x01", "\x1f", "\n", " ", "\x7f", "é", "漢", "\xff",
	}
	plain := strings.Repeat("ab c", 100)
	check := func(str string) {
		t.Helper()
		for _, s := range [][]byte{[]byte(str), []byte(str + `,1`)} {
			want, wantErr := refSkipString(s, 0)
			got, err := skipString(s, 0)
			if got != want || fmt.Sprint(err) != fmt.Sprint(wantErr) {
				t.Fatalf("skipString(%q): %d, %v; want %d, %v", s, got, err, want, wantErr)
			}
			if err == nil && !json.Valid(s[:got]) {
				t.Fatalf("skipString(%q) ends at %d, but encoding/json rejects %q", s, got, s[:got])
			}
			if err != nil && json.Valid([]byte(str)) {
				t.Fatalf("skipString(%q): %v, but encoding/json takes %q", s, err, str)
			}
		}
	}
	for _, stop := range stops {
		for n := 0; n <= 3*longRun+40; n++ {
			for _, tail := range []string{``, `"`, `ab"`, plain[:2*longRun] + `"`, strings.Repeat(`x\"`, 40) + `"`, plain[:100]} {
				check(`"` + plain[:n] + stop + tail)
			}
		}
		for _, n := range []int{0, 10, longRun, 2 * longRun} {
			for k := 0; k <= 40; k++ {
				check(`"` + plain[:n] + `\"` + plain[:k] + stop + `x"`)
			}
		}
	}
}
