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
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// ErrInvalidValue means an [Op] was given a value that is not one JSON
// value.
var ErrInvalidValue = errors.New("jsonobj: a value to set is not one JSON value")

// An Op is one edit of an object's top-level members, made by [Set],
// [Replace], [Delete] or [DeleteFold].
type Op struct {
	kind  opKind
	key   string
	value []byte
}

type opKind uint8

const (
	opSet opKind = iota
	opReplace
	opDelete
	opDeleteFold
)

// Set gives key the JSON value value. The first member named key keeps its
// place and the bytes of its key, with value in place of its old value;
// later members of that name are removed, so that every reader sees value.
// An object without key gets "key":value appended after its last member.
func Set(key string, value []byte) Op { return Op{opSet, key, value} }

// Replace is [Set] for an object that has key: one without it is left as
// it is.
func Replace(key string, value []byte) Op { return Op{opReplace, key, value} }

// Delete removes every member named key.
func Delete(key string) Op { return Op{kind: opDelete, key: key} }

// DeleteFold removes every member whose name is key in any letter case, as
// [strings.EqualFold] compares them. encoding/json matches struct fields
// that way, so a reader in Go sees "KV_Transfer_Params" as
// kv_transfer_params where Python does not.
func DeleteFold(key string) Op { return Op{kind: opDeleteFold, key: key} }

// Edit applies ops to the top-level members of the JSON object obj. Each
// member is decided by the first op whose key matches its own; an op that
// matches no member does nothing, but for a Set, which appends its member
// (in the order of ops). So Edit(obj, DeleteFold(k), Set(k, v)) removes k
// in every letter case and appends "k":v.
//
// Bytes that no op touches come out as they were. When the ops change
// nothing (no member matches, or a Set's value is already there) Edit
// returns obj itself, allocating nothing; otherwise one new slice of
// exactly the result's length. A removed member takes the comma before it
// (after it, for the first one) with it; an appended one is written
// compactly.
//
// obj must be one JSON object, with nothing but whitespace around it:
// anything else is an error wrapping [ErrInvalid]. A Set or Replace whose
// value is not one JSON value is an error wrapping [ErrInvalidValue]. The
// result is valid JSON.
func Edit(obj []byte, ops ...Op) ([]byte, error) {
	var smallDone [16]bool
	var smallChanges [16]change
	p, err := scan(obj, ops, smallDone[:], smallChanges[:0])
	if err != nil {
		return nil, err
	}
	if len(p.changes) == 0 && p.appends == 0 {
		return obj, nil
	}
	var small [40]piece
	pieces := p.pieces(ops, small[:0])
	size := 0
	for _, pc := range pieces {
		size += pc.len(ops)
	}
	out := make([]byte, 0, size)
	for _, pc := range pieces {
		out = pc.append(out, obj, ops)
	}
	return out, nil
}

// EditParts is [Edit] without the copy: the result as the pieces it is
// made of, in order, whose concatenation is what Edit returns. They are
// slices of obj and of the ops' values, commas, and a small slice for the
// key of each appended member. A caller that only writes the result out
// (an HTTP request's body, say) so sends a long obj on without copying
// it. When the ops change nothing, the one piece is obj.
func EditParts(obj []byte, ops ...Op) ([][]byte, error) {
	var smallDone [16]bool
	var smallChanges [16]change
	p, err := scan(obj, ops, smallDone[:], smallChanges[:0])
	if err != nil {
		return nil, err
	}
	if len(p.changes) == 0 && p.appends == 0 {
		return [][]byte{obj}, nil
	}
	var small [40]piece
	pieces := p.pieces(ops, small[:0])
	parts := make([][]byte, 0, len(pieces)+p.appends)
	for _, pc := range pieces {
		switch {
		case pc.comma:
			parts = append(parts, comma)
		case pc.op < 0:
			if pc.to > pc.from {
				parts = append(parts, obj[pc.from:pc.to])
			}
		case pc.key:
			parts = append(parts, append(AppendString(nil, ops[pc.op].key), ':'), ops[pc.op].value)
		default:
			parts = append(parts, ops[pc.op].value)
		}
	}
	return parts, nil
}

var comma = []byte{','}

// A piece of an edit's result: obj[from:to] when op < 0, else the value of
// ops[op], after its key (quoted, and a colon) when key is set; or a comma
// alone. It holds offsets and indexes, not slices: an op's value must not
// be reachable from the heap, or every caller's value would escape to it.
type piece struct {
	from, to, op int
	key, comma   bool
}

func (pc piece) len(ops []Op) int {
	switch {
	case pc.comma:
		return 1
	case pc.op < 0:
		return pc.to - pc.from
	case pc.key:
		return quotedLen(ops[pc.op].key) + 1 + len(ops[pc.op].value)
	}
	return len(ops[pc.op].value)
}

func (pc piece) append(out, obj []byte, ops []Op) []byte {
	switch {
	case pc.comma:
		return append(out, ',')
	case pc.op < 0:
		return append(out, obj[pc.from:pc.to]...)
	case pc.key:
		out = append(AppendString(out, ops[pc.op].key), ':')
	}
	return append(out, ops[pc.op].value...)
}

// pieces appends to out the pieces of the result, in order.
func (p *edits) pieces(ops []Op, out []piece) []piece {
	span := func(from, to int) piece { return piece{from: from, to: to, op: -1} }
	from := 0
	for _, c := range p.changes {
		out = append(out, span(from, c.from))
		switch c.with {
		case dropped:
		case toLead:
			out = append(out, span(p.lead, p.leadEnd))
		default:
			out = append(out, piece{op: c.with})
		}
		from = c.to
	}
	// Appended members go after the last member, or the brace.
	out = append(out, span(from, p.end))
	kept := p.kept
	for j, op := range ops {
		if op.kind != opSet || p.done[j] {
			continue
		}
		if kept == 0 {
			out = append(out, span(p.lead, p.leadEnd))
		} else {
			out = append(out, piece{comma: true})
		}
		out = append(out, piece{op: j, key: true})
		kept++
	}
	return append(out, span(p.end, p.size))
}

// edits is what a scan of an object found for a set of ops.
type edits struct {
	changes []change // in the order of obj
	done    []bool   // done[j]: the Set or Replace ops[j] has its member
	// obj[lead:leadEnd] is the whitespace before the first member: held
	// as offsets, as pieces are, not as a slice.
	lead, leadEnd int
	kept          int // members kept
	appends       int // Set ops with no member, appended after end
	end           int // just past the last member, or the brace
	size          int // len(obj)
}

// scan notes the changes ops make to obj, in order, for Edit and
// EditParts to write. done and changes are their room to note them in.
func scan(obj []byte, ops []Op, done []bool, changes []change) (edits, error) {
	for _, op := range ops {
		if (op.kind == opSet || op.kind == opReplace) && !validValue(op.value) {
			// Copies: the ops' values and keys must not escape, or callers
			// would allocate them.
			return edits{}, fmt.Errorf("%w: %s: %q", ErrInvalidValue, strings.Clone(op.key), string(op.value[:min(len(op.value), 40)]))
		}
	}
	if len(ops) > len(done) {
		done = make([]bool, len(ops))
	}
	m := members{s: obj}
	if err := m.begin(); err != nil {
		return edits{}, err
	}
	lead, leadEnd := 0, 0
	kept := 0
	for {
		more, err := m.next()
		if err != nil {
			return edits{}, err
		}
		if !more {
			break
		}
		if m.n == 1 {
			lead, leadEnd = m.sep, m.key
		}
		raw := obj[m.key+1 : m.keyEnd-1]
		isPlain := plain(raw)
		k := -1
		for j := range ops {
			if keyIs(raw, isPlain, ops[j].key, ops[j].kind == opDeleteFold) {
				k = j
				break
			}
		}
		set := -1 // the op whose value replaces the member's own
		if k >= 0 {
			switch ops[k].kind {
			case opSet, opReplace:
				if !done[k] {
					done[k] = true
					set = k
					break
				}
				fallthrough // a later member of the name: its value would win
			default:
				changes = append(changes, change{m.sep, m.end, dropped})
				continue
			}
		}
		if kept == 0 && m.n > 1 {
			// Those before it are gone: it is the first, and takes the
			// first one's place after the brace.
			changes = append(changes, change{m.sep, m.key, toLead})
		}
		if set >= 0 && !bytes.Equal(obj[m.val:m.end], ops[set].value) {
			changes = append(changes, change{m.val, m.end, set})
		}
		kept++
	}
	if err := m.finish(); err != nil {
		return edits{}, err
	}
	appends := 0
	for j, op := range ops {
		if op.kind == opSet && !done[j] {
			appends++
		}
	}
	return edits{changes: changes, done: done, lead: lead, leadEnd: leadEnd, size: len(obj), kept: kept, appends: appends, end: m.end}, nil
}

// A change puts a value in place of obj[from:to]: ops[with].value, or
// nothing (dropped), or the whitespace before the first member (toLead).
// It holds an index, not the value: an op's value must not be reachable
// from the heap, or every caller's value would escape to it.
type change struct{ from, to, with int }

const (
	dropped = -1 - iota
	toLead
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

// AppendString appends s to dst as a JSON string. Unlike encoding/json it
// escapes only what JSON requires ('"', '\\' and control characters), so
// '<', '>' and '&' stay as they are; invalid UTF-8 becomes \ufffd.
func AppendString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// quotedLen is len(AppendString(nil, s)).
func quotedLen(s string) int {
	n := 2
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c >= 0x20 && c != '"' && c != '\\':
				n++
			case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
				n += 2
			default:
				n += 6
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			n += 6
		} else {
			n += size
		}
		i += size
	}
	return n
}
