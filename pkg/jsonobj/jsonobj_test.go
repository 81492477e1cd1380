package jsonobj

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func TestEdit(t *testing.T) {
	skeleton := []byte(`{"do_remote_decode":true}`)
	for _, tc := range []struct {
		name string
		in   string
		ops  []Op
		want string
	}{
		{"replace keeps place and neighbours", `{"b":1, "a":"<x>"}`, []Op{Set("b", []byte("2"))}, `{"b":2, "a":"<x>"}`},
		{"append before the brace", `{"b":1, "a":"<x>"}`, []Op{Set("c", []byte(`"&"`))}, `{"b":1, "a":"<x>","c":"&"}`},
		{"append keeps the whitespace before the brace", "{\n  \"a\": 1\n}\n", []Op{Set("z", []byte("true"))}, "{\n  \"a\": 1,\"z\":true\n}\n"},
		{"append to an empty object", `{}`, []Op{Set("a", []byte("1")), Set("b", []byte("2"))}, `{"a":1,"b":2}`},
		{"append to an empty object with space", ` { } `, []Op{Set("a", []byte("1"))}, ` {"a":1 } `},
		{"appended keys are escaped", `{}`, []Op{Set("q\"\\\n<", []byte("1"))}, `{"q\"\\\n<":1}`},
		{"delete the first", `{"a":1, "b":2, "c":3}`, []Op{Delete("a")}, `{"b":2, "c":3}`},
		{"delete the middle", `{"a":1, "b":2, "c":3}`, []Op{Delete("b")}, `{"a":1, "c":3}`},
		{"delete the last", `{"a":1, "b":2, "c":3}`, []Op{Delete("c")}, `{"a":1, "b":2}`},
		{"delete the first two, pretty", "{\n  \"a\": 1,\n  \"b\": 2,\n  \"c\": 3\n}", []Op{Delete("a"), Delete("b")}, "{\n  \"c\": 3\n}"},
		{"delete all", `{ "a":1 , "b":2 }`, []Op{Delete("a"), Delete("b")}, `{ }`},
		{"delete all then append", "{\n \"a\":1\n}", []Op{Delete("a"), Set("b", []byte("2"))}, "{\n \"b\":2\n}"},
		{"delete every duplicate", `{"a":1,"b":2,"a":3}`, []Op{Delete("a")}, `{"b":2}`},
		{"set keeps the first duplicate's place and drops the rest", `{"a":1,"b":2,"a":3,"a":4}`, []Op{Set("a", []byte("9"))}, `{"a":9,"b":2}`},
		{"replace only if present", `{"a":1}`, []Op{Replace("a", []byte("2")), Replace("b", []byte("3"))}, `{"a":2}`},
		{"escaped key matches", `{"kv_transfer\u005fparams":{"x":1},"m":"<>&"}`, []Op{Set("kv_transfer_params", []byte(`{"y":2}`))}, `{"kv_transfer\u005fparams":{"y":2},"m":"<>&"}`},
		{"exact match is case-sensitive", `{"Stream":true}`, []Op{Set("stream", []byte("false"))}, `{"Stream":true,"stream":false}`},
		{"fold delete", `{"KV_Transfer_Params":1,"kv_transfer_params":2,"kv_transfer_PARAMS":3,"x":"é"}`, []Op{DeleteFold("kv_transfer_params")}, `{"x":"é"}`},
		{"fold delete: Kelvin sign and escapes", `{"\u212av_transfer_params":1,"x":2}`, []Op{DeleteFold("kv_transfer_params")}, `{"x":2}`},
		{"fold delete then set appends", `{"KV_TRANSFER_PARAMS":1,"x":2}`, []Op{DeleteFold("kv_transfer_params"), Set("kv_transfer_params", []byte("3"))}, `{"x":2,"kv_transfer_params":3}`},
		{"first op decides", `{"a":1,"b":2}`, []Op{Set("a", []byte("5")), Delete("a")}, `{"a":5,"b":2}`},
		{"nested keys are not top-level", `{"m":{"stream":true,"s":"\"stream\":1"},"n":[{"stream":1}]}`, []Op{Delete("stream")}, `{"m":{"stream":true,"s":"\"stream\":1"},"n":[{"stream":1}]}`},
		{"values keep their spelling", `{"n":1.50e+3,"s":"\u00e9\/","u":"漢字"}`, []Op{Set("x", []byte("1"))}, `{"n":1.50e+3,"s":"\u00e9\/","u":"漢字","x":1}`},
		{"prefill", `{"model":"m","messages":[{"role":"user","content":"<hi>"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"min_tokens":5,"temperature":0.7}`,
			[]Op{Set("kv_transfer_params", skeleton), Set("stream", []byte("false")), Set("max_tokens", []byte("1")), Replace("max_completion_tokens", []byte("1")),
				Delete("stream_options"), Delete("min_tokens"), Delete("min_completion_tokens")},
			`{"model":"m","messages":[{"role":"user","content":"<hi>"}],"stream":false,"max_tokens":1,"temperature":0.7,"kv_transfer_params":{"do_remote_decode":true}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Edit([]byte(tc.in), tc.ops...)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Errorf("Edit(%s)\n got  %s\n want %s", tc.in, got, tc.want)
			}
			if !json.Valid(got) {
				t.Errorf("%s is not valid JSON", got)
			}
		})
	}
}

func TestEditUnchanged(t *testing.T) {
	for _, tc := range []struct {
		in  string
		ops []Op
	}{
		{`{"a":1}`, nil},
		{`{"a":1}`, []Op{DeleteFold("kv_transfer_params")}},
		{`{"stream":false}`, []Op{Set("stream", []byte("false"))}},
		{`{"a":1}`, []Op{Replace("b", []byte("2")), Delete("c")}},
		{` {} `, []Op{Delete("a")}},
	} {
		in := []byte(tc.in)
		got, err := Edit(in, tc.ops...)
		if err != nil {
			t.Fatal(err)
		}
		if &got[0] != &in[0] || len(got) != len(in) {
			t.Errorf("Edit(%s) made a copy (%s) where nothing changed", in, got)
		}
	}
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`)
	if n := testing.AllocsPerRun(100, func() {
		if _, err := Edit(body, DeleteFold("kv_transfer_params")); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("a DeleteFold that finds nothing allocates %v times", n)
	}
	if n := testing.AllocsPerRun(100, func() {
		if _, err := Edit(body, Set("max_tokens", []byte("1")), Delete("stream_options"), Set("stream", []byte("false"))); err != nil {
			t.Fatal(err)
		}
	}); n != 1 {
		t.Errorf("an edit allocates %v times, want once", n)
	}
}

func TestEditInvalid(t *testing.T) {
	for _, in := range []string{
		``, ` `, `null`, `[]`, `"x"`, `1`, `{`, `}`, `{"a"}`, `{"a":}`, `{"a":1,}`, `{,"a":1}`, `{"a":1 "b":2}`, `{"a":1}x`, `{"a":1}{}`,
		`{"a":01}`, `{"a":1.}`, `{"a":.5}`, `{"a":-}`, `{"a":1e}`, `{"a":+1}`, `{"a":tru}`, `{"a":nul}`, `{"a":True}`,
		`{"a":"\x"}`, `{"a":"\u12"}`, `{"a":"\u12g4"}`, "{\"a\":\"\x01\"}", `{"a":"unterminated}`, `{"a":[1,]}`, `{"a":[1 2]}`,
		`{"a":{"b"}}`, `{"a":{"b":1,}}`, `{"a":[}`, `{"a":{]}`, `{'a':1}`, `{a:1}`, "\ufeff{}", `{"a":1}]`, `{"a":[1]]}`,
	} {
		if _, err := Edit([]byte(in), Set("x", []byte("1"))); !errors.Is(err, ErrInvalid) {
			t.Errorf("Edit(%q): err = %v, want ErrInvalid", in, err)
		}
		if _, _, err := Get([]byte(in), "a"); err == nil {
			t.Errorf("Get(%q) took it for an object", in)
		}
		if json.Valid([]byte(in)) && strings.HasPrefix(strings.TrimSpace(in), "{") {
			t.Errorf("test case %q is valid JSON", in)
		}
	}
	for _, v := range []string{``, ` `, `1 2`, `{`, `"a`, `01`, `nul`} {
		if _, err := Edit([]byte(`{}`), Set("x", []byte(v))); !errors.Is(err, ErrInvalidValue) {
			t.Errorf("Set(x, %q): err = %v, want ErrInvalidValue", v, err)
		}
	}
}

func TestDepth(t *testing.T) {
	nest := func(depth int) string { // an object holding depth-1 levels
		return `{"a":` + strings.Repeat("[", depth-1) + strings.Repeat("]", depth-1) + `}`
	}
	for _, depth := range []int{1, 2, 300, maxDepth, maxDepth + 1} {
		in := []byte(nest(depth))
		_, err := Edit(in, Set("b", []byte("1")))
		if (err == nil) != json.Valid(in) {
			t.Errorf("depth %d: Edit err = %v, json.Valid = %v", depth, err, json.Valid(in))
		}
	}
	// An object may sit as deep as an array.
	in := []byte(`{"a":` + strings.Repeat(`{"b":[`, maxDepth/2-1) + `{}` + strings.Repeat(`]}`, maxDepth/2-1) + `}`)
	if _, err := Edit(in); (err == nil) != json.Valid(in) {
		t.Errorf("mixed nesting: Edit err = %v, json.Valid = %v", err, json.Valid(in))
	}
}

func TestGet(t *testing.T) {
	obj := []byte(`{"a": 1 ,"b":{"a":2},"c":"x","a" : [3] , "d\u0061":null}`)
	for key, want := range map[string]string{"a": "[3]", "b": `{"a":2}`, "c": `"x"`, "da": "null", "z": ""} {
		got, ok, err := Get(obj, key)
		if err != nil || ok != (want != "") || string(got) != want {
			t.Errorf("Get(%s) = %s, %v, %v; want %s", key, got, ok, err, want)
		}
		if ok && cap(got) != len(got) {
			t.Errorf("Get(%s) leaves room to append over the object", key)
		}
	}
	vals, err := Lookup(obj, "c", "z", "a")
	if err != nil || string(vals[0]) != `"x"` || vals[1] != nil || string(vals[2]) != "[3]" {
		t.Errorf("Lookup = %q, %v", vals, err)
	}
	if n := testing.AllocsPerRun(100, func() { Get(obj, "a") }); n != 0 {
		t.Errorf("Get allocates %v times", n)
	}
}

func TestElements(t *testing.T) {
	arr := []byte(` [ 1, {"a":[2,3]} ,"]" ] `)
	spans, err := Elements(arr)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range spans {
		got = append(got, string(arr[s.Start:s.End]))
	}
	if strings.Join(got, "|") != `1|{"a":[2,3]}|"]"` {
		t.Errorf("Elements = %q", got)
	}
	if spans, err := Elements([]byte(`[]`)); err != nil || len(spans) != 0 {
		t.Errorf("Elements([]) = %v, %v", spans, err)
	}
	for _, bad := range []string{`{}`, `[1,]`, `[1]]`, `[`, `[1 2]`} {
		if _, err := Elements([]byte(bad)); !errors.Is(err, ErrInvalid) {
			t.Errorf("Elements(%s): err = %v", bad, err)
		}
	}
}

func TestAppendString(t *testing.T) {
	for _, s := range []string{"", "plain", `<a href="x">&amp;</a>`, "tab\tnl\ncr\r\x00\x1f\x7f", `back\slash`, "漢字 é 😀", "bad \xff utf8", "\u2028"} {
		got := AppendString([]byte("x"), s)
		var back string
		if err := json.Unmarshal(got[1:], &back); err != nil {
			t.Errorf("AppendString(%q) = %s: %v", s, got, err)
			continue
		}
		want := strings.ToValidUTF8(s, "\ufffd")
		if back != want {
			t.Errorf("AppendString(%q) reads back as %q", s, back)
		}
		if strings.ContainsAny(s, "<>&") && strings.Contains(string(got), `\u00`) && !strings.ContainsAny(s, "\x00\x1f") {
			t.Errorf("AppendString(%q) = %s escapes HTML", s, got)
		}
	}
}

func TestLookupFold(t *testing.T) {
	for _, tc := range []struct {
		obj   string
		role  string
		folds []int
	}{
		{`{"role":"a","content":"b"}`, `"a"`, []int{1, 1}},
		{`{"role":"a","Role":"b","CONTENT":1}`, `"a"`, []int{2, 1}},
		{`{"r\u006fle":"a","x":{"role":1}}`, `"a"`, []int{1, 0}},
		{`{"ROLE":"a"}`, "", []int{1, 0}},
		{`{}`, "", []int{0, 0}},
	} {
		v, folds, err := LookupFold([]byte(tc.obj), "role", "content")
		if err != nil || string(v[0]) != tc.role || !reflect.DeepEqual(folds, tc.folds) {
			t.Errorf("%s: %s, %v, %v; want %s, %v", tc.obj, v[0], folds, err, tc.role, tc.folds)
		}
	}
	if _, _, err := LookupFold([]byte(`[1]`), "role"); err == nil {
		t.Error("an array: no error")
	}
}

func TestCut(t *testing.T) {
	for _, tc := range []struct {
		in, rest string
		values   []string // of "messages", "prompt"; "" for absent
		counts   []int
		same     bool // rest is the input itself
	}{
		{in: `{"model":"m","messages":[{"a":1}],"stream":true}`, rest: `{"model":"m","stream":true}`, values: []string{`[{"a":1}]`, ""}, counts: []int{1, 0}},
		{in: ` { "prompt" : "x" , "n" : 2 , "prompt" : "y" } `, rest: `{"n" : 2}`, values: []string{"", `"y"`}, counts: []int{0, 2}},
		{in: `{"messages":1,"prompt":2}`, rest: `{}`, values: []string{"1", "2"}, counts: []int{1, 1}},
		{in: `{"Messages":1}`, rest: `{"Messages":1}`, values: []string{"", ""}, counts: []int{0, 0}, same: true},
	} {
		values, counts, rest, err := Cut([]byte(tc.in), "messages", "prompt")
		if err != nil {
			t.Fatalf("Cut(%s): %v", tc.in, err)
		}
		if !reflect.DeepEqual(counts, tc.counts) {
			t.Errorf("Cut(%s) counts = %v, want %v", tc.in, counts, tc.counts)
		}
		for i, want := range tc.values {
			if got := string(values[i]); got != want || (want == "") != (values[i] == nil) {
				t.Errorf("Cut(%s) value %d = %q, want %q", tc.in, i, got, want)
			}
		}
		if string(rest) != tc.rest && !(tc.same && string(rest) == tc.in) {
			t.Errorf("Cut(%s) rest = %s, want %s", tc.in, rest, tc.rest)
		}
	}
	for _, bad := range []string{`[]`, `{"a":}`, `{"messages":1} x`, ``} {
		if _, _, _, err := Cut([]byte(bad), "messages"); !errors.Is(err, ErrInvalid) {
			t.Errorf("Cut(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}

func TestLookupEach(t *testing.T) {
	in := ` [ {"role":"user","content":"hi","Role":"x"} , {"content":[{"type":"text"}]} , {} ] `
	var got []string
	err := LookupEach([]byte(in), []string{"role", "content"}, func(i int, el []byte, v []json.RawMessage, folds []int) error {
		got = append(got, fmt.Sprintf("%d %s %s %s %v", i, el, v[0], v[1], folds))
		return nil
	})
	want := []string{`0 {"role":"user","content":"hi","Role":"x"} "user" "hi" [2 1]`, `1 {"content":[{"type":"text"}]}  [{"type":"text"}] [0 1]`, `2 {}   [0 0]`}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("LookupEach = %q, %v; want %q", got, err, want)
	}
	stop := errors.New("stop")
	calls := 0
	if err := LookupEach([]byte(in), []string{"role"}, func(int, []byte, []json.RawMessage, []int) error { calls++; return stop }); err != stop || calls != 1 {
		t.Errorf("LookupEach = %v after %d calls; want f's error after one", err, calls)
	}
	for _, bad := range []string{`{}`, `[1]`, `[{"a":1},]`, `[{}] x`, `[{"a":}]`} {
		if err := LookupEach([]byte(bad), []string{"a"}, func(int, []byte, []json.RawMessage, []int) error { return nil }); !errors.Is(err, ErrInvalid) {
			t.Errorf("LookupEach(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}

func TestEmpty(t *testing.T) {
	for raw, want := range map[string]bool{
		"": true, "null": true, `""`: true, "[]": true, "{}": true, "[ ]": true, "{\n}": true,
		`" "`: true, "0": false, "false": false, "[null]": false, `{"a":1}`: false, `"x"`: false,
	} {
		if got := Empty(json.RawMessage(raw)); got != want {
			t.Errorf("Empty(%q) = %v, want %v", raw, got, want)
		}
	}
}
