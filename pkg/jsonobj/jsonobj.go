// Package jsonobj edits and reads the top-level members of a JSON object
// without decoding it. An edit copies the object's bytes and splices in
// the values it sets: every member it does not touch keeps its bytes,
// its place and the whitespace around it, and nothing is re-encoded (no
// key sorting, no escaping of '<', '>' or '&', numbers as they were
// written). The object is scanned once, by a scanner that allocates
// nothing, and the result is allocated once, sized up front.
//
// Keys are compared as encoding/json decodes them: "a\u0062" is the key
// "ab", and invalid UTF-8 or a lone surrogate reads as U+FFFD. Matching is
// exact, as vLLM's pydantic models match field names, but for
// [DeleteFold]. Where a key is in an object twice, the last one is what
// Python's json module, pydantic and encoding/json read: [Get] returns
// it, and [Set] leaves one member with its value.
//
// Input is what [encoding/json.Valid] accepts, including its nesting limit
// of 10000; anything else is an error wrapping [ErrInvalid].
package jsonobj

import (
	"bytes"
	"encoding/json"
)

// members reads the members of an object, one at a time.
type members struct {
	s []byte
	i int // where the scan is
	n int // members read
	// outer is the number of arrays and objects around the object: 0 for
	// a document's top level.
	outer int
	// The member read last: the separator from the one before (or from
	// the brace) at s[sep:key], its key with quotes at s[key:keyEnd], its
	// value at s[val:end]. Before the first member, end is just past the
	// brace.
	sep, key, keyEnd, val, end int
}

func (m *members) begin() error { return m.beginAt(0) }

// beginAt starts reading the object at m.s[i], after any whitespace.
func (m *members) beginAt(i int) error {
	i = skipSpace(m.s, i)
	if at(m.s, i) != '{' {
		return syntaxError(m.s, i, "object expected")
	}
	m.i, m.end = i+1, i+1
	return nil
}

// next reads the next member, or finds the closing brace and returns
// false.
func (m *members) next() (bool, error) {
	s := m.s
	i := skipSpace(s, m.i)
	switch c := at(s, i); {
	case c == '}':
		m.i = i
		return false, nil
	case m.n > 0 && c == ',':
		i = skipSpace(s, i+1)
	case m.n > 0:
		return false, syntaxError(s, i, "',' or '}' expected")
	}
	if at(s, i) != '"' {
		return false, syntaxError(s, i, "object key expected")
	}
	m.sep, m.key = m.end, i
	i, err := skipString(s, i)
	if err != nil {
		return false, err
	}
	m.keyEnd = i
	i = skipSpace(s, i)
	if at(s, i) != ':' {
		return false, syntaxError(s, i, "':' expected")
	}
	m.val = skipSpace(s, i+1)
	if m.end, err = skipValue(s, m.val, 1+m.outer); err != nil {
		return false, err
	}
	m.i = m.end
	m.n++
	return true, nil
}

// each reads the members left, calling f with each one's name as written
// (without the quotes) and whether that needs no unescaping; the rest of
// the member is in m's fields when f runs. It stops at the closing brace.
func (m *members) each(f func(raw []byte, isPlain bool)) error {
	for {
		more, err := m.next()
		if err != nil || !more {
			return err
		}
		raw := m.s[m.key+1 : m.keyEnd-1]
		f(raw, plain(raw))
	}
}

// finish checks that nothing but whitespace follows the closing brace,
// where next left the scan.
func (m *members) finish() error {
	if i := skipSpace(m.s, m.i+1); i != len(m.s) {
		return syntaxError(m.s, i, "end of input expected after the object")
	}
	return nil
}

// Empty reports whether a value, as Get or Lookup returns it, is missing,
// null, or an empty (or blank) string, list or object: what a reader of a
// request or response takes as not there.
func Empty(raw json.RawMessage) bool {
	switch string(bytes.Join(bytes.Fields(raw), nil)) {
	case "", "null", `""`, "[]", "{}":
		return true
	}
	return false
}

// Get returns the value of the top-level member key of the JSON object
// obj, the last one if the key is there twice, as a slice of obj (no
// copy, capacity cut to its length), without the whitespace around it.
// The whole of obj is read, and must be one JSON object (else the error
// wraps [ErrInvalid]).
func Get(obj []byte, key string) (value json.RawMessage, ok bool, err error) {
	err = eachMember(obj, func(raw []byte, isPlain bool, val, end int) {
		if keyIs(raw, isPlain, key, false) {
			value, ok = obj[val:end:end], true
		}
	})
	if err != nil {
		return nil, false, err
	}
	return value, ok, nil
}

// Lookup is [Get] for several keys in one scan: values[i] is the value of
// keys[i], nil when obj has no such member.
func Lookup(obj []byte, keys ...string) (values []json.RawMessage, err error) {
	values = make([]json.RawMessage, len(keys))
	err = eachMember(obj, func(raw []byte, isPlain bool, val, end int) {
		match(keys, values, nil, raw, isPlain, obj[val:end:end])
	})
	if err != nil {
		return nil, err
	}
	return values, nil
}

// LookupFold is [Lookup] that also counts, for each key, the members
// named so in any letter case, as encoding/json matches struct fields
// (after unescaping the names): a reader that takes keys as they are
// spelled can tell from folds whether encoding/json would read another
// member in their place.
func LookupFold(obj []byte, keys ...string) (values []json.RawMessage, folds []int, err error) {
	values, folds = make([]json.RawMessage, len(keys)), make([]int, len(keys))
	err = eachMember(obj, func(raw []byte, isPlain bool, val, end int) {
		match(keys, values, folds, raw, isPlain, obj[val:end:end])
	})
	if err != nil {
		return nil, nil, err
	}
	return values, folds, nil
}

// match takes in one member, named raw, for Lookup (folds nil) or
// LookupFold: values[i] becomes value when it is named keys[i], and
// folds[i] counts it when it is so named in any letter case.
func match(keys []string, values []json.RawMessage, folds []int, raw []byte, isPlain bool, value []byte) {
	for i, key := range keys {
		if folds != nil && keyIs(raw, isPlain, key, true) {
			folds[i]++
		}
		if keyIs(raw, isPlain, key, false) {
			values[i] = value
		}
	}
}

// Cut is [Lookup] and an [Edit] that deletes those keys, in one scan:
// values[i] is the value of keys[i] (the last one if the key is there
// twice, nil when obj has none), counts[i] how many members are so named,
// and rest is obj without any of them, a new object of the other members
// as written, joined by commas; obj itself when it has none of them. obj
// must be one JSON object (else the error wraps [ErrInvalid]).
func Cut(obj []byte, keys ...string) (values []json.RawMessage, counts []int, rest []byte, err error) {
	values, counts = make([]json.RawMessage, len(keys)), make([]int, len(keys))
	var kept []Span // the other members, key to value
	cut := false
	m := members{s: obj}
	if err := m.begin(); err != nil {
		return nil, nil, nil, err
	}
	err = m.each(func(raw []byte, isPlain bool) {
		hit := false
		for i, key := range keys {
			if keyIs(raw, isPlain, key, false) {
				values[i], hit = obj[m.val:m.end:m.end], true
				counts[i]++
			}
		}
		if hit {
			cut = true
		} else {
			kept = append(kept, Span{m.key, m.end})
		}
	})
	if err == nil {
		err = m.finish()
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if !cut {
		return values, counts, obj, nil
	}
	size := 1 + len(kept)
	for _, sp := range kept {
		size += sp.End - sp.Start
	}
	rest = make([]byte, 0, size)
	rest = append(rest, '{')
	for i, sp := range kept {
		if i > 0 {
			rest = append(rest, ',')
		}
		rest = append(rest, obj[sp.Start:sp.End]...)
	}
	return values, counts, append(rest, '}'), nil
}

// LookupEach is [LookupFold] of every element of the JSON array arr, in
// one scan: f gets each element's index, the element (a slice of arr),
// the values of keys and their folds. The two slices are reused from one element to the next (copy
// them to keep them; the values are slices of arr, and can be kept).
// Every element must be an object, and arr one JSON array with nothing but
// whitespace around it (else the error wraps [ErrInvalid]); f has run for
// the elements before an error is found, so a caller drops what f
// gathered when LookupEach fails. It stops at f's first error, and
// returns it.
func LookupEach(arr []byte, keys []string, f func(i int, el []byte, values []json.RawMessage, folds []int) error) error {
	i := skipSpace(arr, 0)
	if at(arr, i) != '[' {
		return syntaxError(arr, i, "array expected")
	}
	i = skipSpace(arr, i+1)
	values, folds := make([]json.RawMessage, len(keys)), make([]int, len(keys))
	if at(arr, i) == ']' {
		i++
	} else {
		for n := 0; ; n++ {
			clear(values)
			clear(folds)
			start := skipSpace(arr, i)
			m := members{s: arr, outer: 1}
			if err := m.beginAt(start); err != nil {
				return err
			}
			err := m.each(func(raw []byte, isPlain bool) {
				match(keys, values, folds, raw, isPlain, arr[m.val:m.end:m.end])
			})
			if err != nil {
				return err
			}
			if err := f(n, arr[start:m.i+1:m.i+1], values, folds); err != nil {
				return err
			}
			i = skipSpace(arr, m.i+1) // past the element's closing brace
			if c := at(arr, i); c == ']' {
				i++
				break
			} else if c != ',' {
				return syntaxError(arr, i, "',' or ']' expected")
			}
			i = skipSpace(arr, i+1)
		}
	}
	if i = skipSpace(arr, i); i != len(arr) {
		return syntaxError(arr, i, "end of input expected after the array")
	}
	return nil
}

// eachMember calls f with each top-level member of the JSON object obj:
// its name as written (without the quotes), whether that needs no
// unescaping, and where its value lies, obj[val:end]. The whole of obj is
// read, and must be one JSON object.
func eachMember(obj []byte, f func(raw []byte, isPlain bool, val, end int)) error {
	m := members{s: obj}
	if err := m.begin(); err != nil {
		return err
	}
	if err := m.each(func(raw []byte, isPlain bool) { f(raw, isPlain, m.val, m.end) }); err != nil {
		return err
	}
	return m.finish()
}

// Span is where a value lies in a document: doc[Start:End].
type Span struct{ Start, End int }

// Elements returns where the elements of the JSON array arr lie in it, in
// order. arr must be one JSON array, with nothing but whitespace around it
// (else the error wraps [ErrInvalid]).
func Elements(arr []byte) ([]Span, error) {
	i := skipSpace(arr, 0)
	if at(arr, i) != '[' {
		return nil, syntaxError(arr, i, "array expected")
	}
	i = skipSpace(arr, i+1)
	var spans []Span
	if at(arr, i) == ']' {
		i++
	} else {
		for {
			start := i
			end, err := skipValue(arr, i, 1)
			if err != nil {
				return nil, err
			}
			spans = append(spans, Span{start, end})
			i = skipSpace(arr, end)
			if c := at(arr, i); c == ']' {
				i++
				break
			} else if c != ',' {
				return nil, syntaxError(arr, i, "',' or ']' expected")
			}
			i = skipSpace(arr, i+1)
		}
	}
	if i = skipSpace(arr, i); i != len(arr) {
		return nil, syntaxError(arr, i, "end of input expected after the array")
	}
	return spans, nil
}
