package jsonobj

import (
	"bytes"
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// fuzzOps are the edits FuzzEdit picks from.
var fuzzOps = []Op{
	Set("a", []byte(`1`)),
	Set("b", []byte(`{"x":[1,"<>&"]}`)),
	Set("kv_transfer_params", []byte(`{"do_remote_decode":true,"remote_host":null}`)),
	Replace("a", []byte(`"r"`)),
	Replace("stream", []byte(`false`)),
	Delete("a"),
	Delete("b"),
	Delete("stream_options"),
	DeleteFold("kv_transfer_params"),
	DeleteFold("k"),
	Set("é", []byte(`null`)),
	DeleteFold("É"),
	Set("q\"\\<\n", []byte(`[]`)),
	Set("", []byte(`""`)),
	Delete("\ufffd"),
	Replace("A", []byte(`true`)),
	DeleteFold("ſ"), // folds with s and S
	Set("stream", []byte(`false`)),
}

var fuzzSeeds = []string{
	`{}`, ` { } `, `{"a":1}`, `{"b":1, "a":"<x>"}`,
	`{"model":"m","messages":[{"role":"user","content":"hi {\"a\":1} ]}"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50}`,
	`{"a":1,"a":2,"b":3,"a":4}`, `{"A":1,"a":2}`,
	`{"kv_transfer_params":{"x":1},"KV_Transfer_Params":2,"kv_transfer\u005fparams":3,"\u212av_transfer_params":4}`,
	`{"\u00e9":1,"é":2,"\u00c9":3}`, `{"\ud800":1,"\ud83d\ude00":2,"\udc00\u0041":3}`, "{\"\xff\":1,\"\xef\xbf\xbd\":2}",
	`{"s":"\"\\\/\b\f\n\r\t\u0000","n":[-0,0.5e-3,1E+9,-12.34]}`, `{"\u017ftream":true,"STREAM":1}`,
	"{\n  \"a\": [\n    1,\n    {\"b\": {}}\n  ],\n  \"c\": null\n}\n",
	`{"a":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `}`,
	`{"a":{"b":{"c":{"d":[{"e":[[[]]]}]}}}}`, `{"a":true,"b":false,"c":null}`,
	`{"a":"` + strings.Repeat("x y", 40) + `\"x\n` + strings.Repeat("z", 70) + `\u00e9` + strings.Repeat("w", 33) + `"}`,
	`[]`, `[1,2]`, `null`, `"x"`, `1`, `{"a":1}x`, `{"a":}`, `{"a":01}`, `{"a":[1,]}`, `{"a":"\u12"}`, "{\"a\":\"\x01\"}", `{`, ``,
}

func FuzzEdit(f *testing.F) {
	for i, s := range fuzzSeeds {
		f.Add([]byte(s), []byte{byte(i), byte(3 * i), byte(7 * i)})
	}
	f.Add([]byte(`{"a":1,"b":2,"stream":true}`), []byte{8, 0, 2, 4, 7, 17})
	f.Fuzz(func(t *testing.T, in, sel []byte) {
		if len(sel) > 8 {
			sel = sel[:8]
		}
		ops := make([]Op, len(sel))
		for i, b := range sel {
			ops[i] = fuzzOps[int(b)%len(fuzzOps)]
		}
		orig := bytes.Clone(in)
		out, err := Edit(in, ops...)
		parts, perr := EditParts(in, ops...)
		if !bytes.Equal(in, orig) {
			t.Fatal("Edit changed its input")
		}
		if (err == nil) != (perr == nil) || err == nil && !bytes.Equal(bytes.Join(parts, nil), out) {
			t.Fatalf("EditParts(%q) = %q, %v; Edit = %q, %v", in, parts, perr, out, err)
		}
		isObject := json.Valid(in) && bytes.TrimLeft(in, " \t\r\n")[0] == '{'
		if !isObject {
			if err == nil {
				t.Fatalf("Edit(%q) accepted what json.Valid does not take for an object", in)
			}
			if _, _, err := Get(in, "a"); err == nil {
				t.Fatalf("Get(%q) accepted what json.Valid does not take for an object", in)
			}
			return
		}
		if err != nil {
			t.Fatalf("Edit(%q): %v", in, err)
		}
		if &out[0] != &in[0] && cap(out) != len(out) {
			t.Fatalf("Edit(%q) = %q with capacity %d: not sized exactly", in, out, cap(out))
		}
		if !json.Valid(out) {
			t.Fatalf("Edit(%q) = %q: not valid JSON", in, out)
		}
		inMap := decode(t, in).(map[string]any)
		if got, want := decode(t, out), model(inMap, ops); !reflect.DeepEqual(got, want) {
			t.Fatalf("Edit(%q, %v)\n = %q\n reads as %v\n want      %v", in, ops, out, got, want)
		}
		if got, want := rawMembers(t, out), modelMembers(rawMembers(t, in), ops); !reflect.DeepEqual(got, want) {
			t.Fatalf("Edit(%q, %v) = %q\n members %q\n want    %q", in, ops, out, got, want)
		}
		// Get and Lookup read what encoding/json reads.
		keys := make([]string, 0, len(inMap))
		for k, v := range inMap {
			raw, ok, err := Get(in, k)
			if err != nil || !ok || !reflect.DeepEqual(decode(t, raw), v) {
				t.Fatalf("Get(%q, %q) = %q, %v, %v; want %v", in, k, raw, ok, err, v)
			}
			keys = append(keys, k)
		}
		keys = append(keys, "\x00absent")
		vals, err := Lookup(in, keys...)
		if err != nil || vals[len(keys)-1] != nil {
			t.Fatalf("Lookup(%q): %q, %v", in, vals, err)
		}
		for i, k := range keys[:len(keys)-1] {
			if !reflect.DeepEqual(decode(t, vals[i]), inMap[k]) {
				t.Fatalf("Lookup(%q, %q) = %q", in, k, vals[i])
			}
		}
	})
}

func FuzzElements(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(` [ 1, {"a":[2,"]"]} ,"]" ] `))
	f.Fuzz(func(t *testing.T, in []byte) {
		spans, err := Elements(in)
		if !json.Valid(in) || bytes.TrimLeft(in, " \t\r\n")[0] != '[' {
			if err == nil {
				t.Fatalf("Elements(%q) accepted what json.Valid does not take for an array", in)
			}
			return
		}
		if err != nil {
			t.Fatalf("Elements(%q): %v", in, err)
		}
		want := decode(t, in).([]any)
		got := make([]any, len(spans))
		for i, s := range spans {
			got[i] = decode(t, in[s.Start:s.End])
		}
		if len(got) != len(want) || (len(got) > 0 && !reflect.DeepEqual(got, want)) {
			t.Fatalf("Elements(%q): %v, want %v", in, got, want)
		}
	})
}

func decode(t *testing.T, b []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("%q: %v", b, err)
	}
	return v
}

func matches(op Op, key string) bool {
	if op.kind == opDeleteFold {
		return strings.EqualFold(key, op.key)
	}
	return key == op.key
}

// model applies ops to the decoded object m: each key is decided by the
// first op that matches it, and a Set that matched none adds its key.
func model(m map[string]any, ops []Op) map[string]any {
	out := map[string]any{}
	used := make([]bool, len(ops))
	for k, v := range m {
		out[k] = v
		for j, op := range ops {
			if !matches(op, k) {
				continue
			}
			used[j] = true
			if op.kind == opSet || op.kind == opReplace {
				out[k] = decodeValue(op.value)
			} else {
				delete(out, k)
			}
			break
		}
	}
	for j, op := range ops {
		if op.kind == opSet && !used[j] {
			out[op.key] = decodeValue(op.value)
		}
	}
	return out
}

func decodeValue(b []byte) any {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		panic(err)
	}
	return v
}

type member struct {
	Key   string
	Value string // raw bytes
}

// rawMembers lists an object's members in order, with their values' bytes.
func rawMembers(t *testing.T, obj []byte) []member {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(obj))
	if _, err := dec.Token(); err != nil {
		t.Fatal(err)
	}
	var ms []member
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			t.Fatal(err)
		}
		ms = append(ms, member{tok.(string), string(raw)})
	}
	return ms
}

// modelMembers is what Edit must make of an object's members: the
// untouched ones byte for byte and in place.
func modelMembers(in []member, ops []Op) []member {
	var out []member
	done := make([]bool, len(ops))
	for _, m := range in {
		j := -1
		for i, op := range ops {
			if matches(op, m.Key) {
				j = i
				break
			}
		}
		switch {
		case j < 0:
			out = append(out, m)
		case (ops[j].kind == opSet || ops[j].kind == opReplace) && !done[j]:
			done[j] = true
			out = append(out, member{m.Key, string(ops[j].value)})
		}
	}
	for j, op := range ops {
		if op.kind == opSet && !done[j] {
			out = append(out, member{op.key, string(op.value)})
		}
	}
	return out
}

// fuzzKeys are the keys FuzzCut and FuzzLookupEach pick from.
var fuzzKeys = []string{"a", "b", "A", "messages", "prompt", "é", "", "\ufffd", "s", "kv_transfer_params"}

// FuzzCut checks Cut against Lookup and an Edit that deletes the keys:
// the same values, and a rest that reads the same.
func FuzzCut(f *testing.F) {
	for i, s := range fuzzSeeds {
		f.Add([]byte(s), []byte{byte(i), byte(2 * i)})
	}
	f.Add([]byte(`{"a":1, "messages":[{"x":"y"}] ,"b":2,"a":3}`), []byte{0, 3})
	f.Fuzz(func(t *testing.T, in, sel []byte) {
		if len(sel) > 4 {
			sel = sel[:4]
		}
		keys := make([]string, len(sel))
		ops := make([]Op, len(sel))
		for i, b := range sel {
			keys[i] = fuzzKeys[int(b)%len(fuzzKeys)]
			ops[i] = Delete(keys[i])
		}
		values, counts, rest, err := Cut(in, keys...)
		want, werr := Lookup(in, keys...)
		edited, eerr := Edit(in, ops...)
		if (err == nil) != (werr == nil) || (err == nil) != (eerr == nil) {
			t.Fatalf("Cut(%q, %q): %v; Lookup: %v; Edit: %v", in, keys, err, werr, eerr)
		}
		if err != nil {
			return
		}
		if !reflect.DeepEqual(values, want) {
			t.Fatalf("Cut(%q, %q) values %q, Lookup %q", in, keys, values, want)
		}
		for i, k := range keys {
			n := 0
			eachMember(in, func(raw []byte, isPlain bool, _, _ int) {
				if keyIs(raw, isPlain, k, false) {
					n++
				}
			})
			if counts[i] != n {
				t.Fatalf("Cut(%q, %q) counts %d of %q, want %d", in, keys, counts[i], k, n)
			}
		}
		var got, wantRest bytes.Buffer
		if json.Compact(&got, rest) != nil || json.Compact(&wantRest, edited) != nil || got.String() != wantRest.String() {
			t.Fatalf("Cut(%q, %q) rest %q, Edit %q", in, keys, rest, edited)
		}
	})
}

// FuzzLookupEach checks LookupEach against Elements and LookupFold of each
// element.
func FuzzLookupEach(f *testing.F) {
	for i, s := range fuzzSeeds {
		f.Add([]byte(s), []byte{byte(i), byte(2 * i)})
	}
	f.Add([]byte(` [ {"role":"u","content":"x","Role":1} , {"a":[{"b":1}],"A":2} ] `), []byte{0, 2})
	f.Fuzz(func(t *testing.T, in, sel []byte) {
		if len(sel) > 4 {
			sel = sel[:4]
		}
		keys := make([]string, len(sel))
		for i, b := range sel {
			keys[i] = fuzzKeys[int(b)%len(fuzzKeys)]
		}
		type found struct {
			values []json.RawMessage
			folds  []int
		}
		var got []found
		spans, _ := Elements(in)
		err := LookupEach(in, keys, func(i int, el []byte, values []json.RawMessage, folds []int) error {
			if i != len(got) {
				t.Fatalf("element %d after %d", i, len(got))
			}
			// Elements finds no spans in an invalid array, for whose first
			// elements f may still run.
			if i < len(spans) && !bytes.Equal(el, in[spans[i].Start:spans[i].End]) || !json.Valid(el) {
				t.Fatalf("LookupEach(%q): element %d is %q, not Elements' span", in, i, el)
			}
			got = append(got, found{slices.Clone(values), slices.Clone(folds)})
			return nil
		})
		var want []found
		spans, werr := Elements(in)
		for _, sp := range spans {
			if werr != nil {
				break
			}
			var fd found
			fd.values, fd.folds, werr = LookupFold(in[sp.Start:sp.End], keys...)
			want = append(want, fd)
		}
		if (err == nil) != (werr == nil) {
			t.Fatalf("LookupEach(%q, %q): %v; Elements and LookupFold: %v", in, keys, err, werr)
		}
		if err == nil && len(got)+len(want) > 0 && !reflect.DeepEqual(got, want) {
			t.Fatalf("LookupEach(%q, %q) = %+v, want %+v", in, keys, got, want)
		}
	})
}
