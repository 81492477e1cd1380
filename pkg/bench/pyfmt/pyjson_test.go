package pyfmt

import (
	"encoding/json"
	"math"
	"testing"
)

func TestDumps(t *testing.T) {
	o := Object{
		{"a", 1.0},
		{"b", []float64{0.1, 1e-05, 1e16, 123456789.0, math.Copysign(0, -1)}},
		{"c", nil},
		{"d", "é\n\x01\"<>&😀\x7f"},
		{"e", math.Inf(1)},
		{"f", [][]float64{{0.5}, {}}},
		{"g", true},
		{"h", 3},
	}
	// json.dumps of the same dict in Python 3.11.
	want := `{"a": 1.0, "b": [0.1, 1e-05, 1e+16, 123456789.0, -0.0], "c": null, "d": "\u00e9\n\u0001\"<>&\ud83d\ude00\u007f", "e": Infinity, "f": [[0.5], []], "g": true, "h": 3}`
	got, err := Dumps(o)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("Dumps:\n got %s\nwant %s", got, want)
	}
}

func TestRepr(t *testing.T) {
	for f, want := range map[float64]string{
		math.Inf(1): "inf", 10: "10.0", 0.5: "0.5", 1e-4: "0.0001", 99.9: "99.9", 1e22: "1e+22", 0: "0.0",
	} {
		if got := Repr(f); got != want {
			t.Errorf("Repr(%v) = %q, want %q", f, got, want)
		}
	}
}

func TestObjectSetKeepsOrder(t *testing.T) {
	var o Object
	o.Set("x", 1)
	o.Set("y", 2)
	o.Set("x", 3)
	o.Del("y")
	o.Set("z", 4)
	got, _ := Dumps(o)
	if want := `{"x": 3, "z": 4}`; got != want {
		t.Errorf("got %s, want %s", got, want)
	}
	var back map[string]int
	if err := json.Unmarshal([]byte(got), &back); err != nil || back["x"] != 3 {
		t.Errorf("does not read back: %v %v", back, err)
	}
}
