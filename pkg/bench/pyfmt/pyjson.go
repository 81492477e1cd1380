package pyfmt

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// This file writes JSON as Python's json.dump writes vLLM's result dict,
// so that a result file from pdq bench reads like one from vLLM: members
// in insertion order, ", " and ": " separators, floats as Python's repr
// (1.0, not 1; NaN and Infinity as Python writes them), and every
// non-ASCII character escaped (ensure_ascii).

// member is one key and value of an [Object].
type member struct {
	key   string
	value any
}

// Object is a JSON object whose members keep their order, like a Python
// dict, because vLLM's result file lists its keys in the order serve.py
// assigns them and a file that reads like vLLM's must too.
type Object []member

// Set replaces the value of key, or appends key, as assigning to a Python
// dict does, so a key set again keeps its first place.
func (o *Object) Set(key string, value any) {
	for i := range *o {
		if (*o)[i].key == key {
			(*o)[i].value = value
			return
		}
	}
	*o = append(*o, member{key, value})
}

// Del removes key, as Python's del does, keeping the order of the keys
// after it: vLLM drops the per-request lists from its result dict this
// way when --save-detailed is not given.
func (o *Object) Del(key string) {
	for i := range *o {
		if (*o)[i].key == key {
			*o = append((*o)[:i], (*o)[i+1:]...)
			return
		}
	}
}

// Get returns the value of key, and whether it is there, as dict.get
// does: vLLM names a result file after the date its result holds.
func (o Object) Get(key string) (any, bool) {
	for _, m := range o {
		if m.key == key {
			return m.value, true
		}
	}
	return nil, false
}

// Dumps is json.dumps(v) for the values a result holds: nil, bool, int,
// float64, string, []int, []float64, [][]float64, []string, []any and
// [Object]; encoding/json would write 1 for 1.0, refuse NaN and leave
// non-ASCII text unescaped, where vLLM's files do otherwise.
func Dumps(v any) (string, error) {
	var b strings.Builder
	if err := pyWrite(&b, v); err != nil {
		return "", err
	}
	return b.String(), nil
}

func pyWrite(b *strings.Builder, v any) error {
	switch v := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		if v {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case int:
		b.WriteString(strconv.Itoa(v))
	case float64:
		b.WriteString(pyJSONFloat(v))
	case string:
		pyString(b, v)
	case []int:
		return pyList(b, len(v), func(i int) any { return v[i] })
	case []float64:
		return pyList(b, len(v), func(i int) any { return v[i] })
	case [][]float64:
		return pyList(b, len(v), func(i int) any { return v[i] })
	case []string:
		return pyList(b, len(v), func(i int) any { return v[i] })
	case []any:
		return pyList(b, len(v), func(i int) any { return v[i] })
	case Object:
		b.WriteByte('{')
		for i, m := range v {
			if i > 0 {
				b.WriteString(", ")
			}
			pyString(b, m.key)
			b.WriteString(": ")
			if err := pyWrite(b, m.value); err != nil {
				return err
			}
		}
		b.WriteByte('}')
	default:
		return fmt.Errorf("bench: cannot write %T as JSON", v)
	}
	return nil
}

func pyList(b *strings.Builder, n int, at func(int) any) error {
	b.WriteByte('[')
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		if err := pyWrite(b, at(i)); err != nil {
			return err
		}
	}
	b.WriteByte(']')
	return nil
}

// pyJSONFloat is how json.dumps writes a float: its repr, with NaN,
// Infinity and -Infinity for the values JSON has no number for.
func pyJSONFloat(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	return Repr(f)
}

// Repr is Python's repr (and str) of a float: the shortest digits that
// read back as f, in positional notation from 1e-4 up to 1e16 with at least
// one decimal, else in exponent notation ("1e-05", "1.5e+16"), and "inf",
// "-inf", "nan". vLLM prints its request rate and names its result files
// with it, where Go's %v would write 10.0 as "10".
func Repr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "nan"
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	}
	if a := math.Abs(f); a != 0 && (a < 1e-4 || a >= 1e16) {
		return strconv.FormatFloat(f, 'e', -1, 64)
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsRune(s, '.') {
		s += ".0"
	}
	return s
}

// pyString writes s as json.dumps does with ensure_ascii: the two-letter
// escapes, \u00XX for other control characters, \uXXXX (in lower-case hex,
// as surrogate pairs beyond the BMP) for everything past ASCII.
func pyString(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"':
			b.WriteString(`\"`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\b':
			b.WriteString(`\b`)
		case r == '\f':
			b.WriteString(`\f`)
		case r < 0x20 || (r >= 0x7f && r < 0x10000):
			fmt.Fprintf(b, `\u%04x`, r)
		case r >= 0x10000:
			r -= 0x10000
			fmt.Fprintf(b, `\u%04x\u%04x`, 0xd800+(r>>10), 0xdc00+(r&0x3ff))
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
}
