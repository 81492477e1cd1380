package jsonobj

import (
	"bytes"
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
