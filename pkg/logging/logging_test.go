package logging

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestParseLevel(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    slog.Level
		wantErr bool
	}{
		{"", slog.LevelInfo, false},
		{"info", slog.LevelInfo, false},
		{"DEBUG", slog.LevelDebug, false},
		{"warning", slog.LevelWarn, false},
		{" error ", slog.LevelError, false},
		{"verbose", 0, true},
	} {
		got, err := ParseLevel(tc.in)
		if (err != nil) != tc.wantErr || (!tc.wantErr && got != tc.want) {
			t.Errorf("ParseLevel(%q) = %v, %v; want %v, err %v", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestNewFormats(t *testing.T) {
	t.Run("auto is JSON when not a terminal", func(t *testing.T) {
		var buf bytes.Buffer
		log, err := New(&buf, "info", FormatAuto)
		if err != nil {
			t.Fatal(err)
		}
		log.Debug("hidden")
		log.Info("hello", KeyRequestID, "r1")
		var rec map[string]any
		if err := json.Unmarshal(buf.Bytes(), &rec); err != nil {
			t.Fatalf("want one JSON line, got %q: %v", buf.String(), err)
		}
		if rec["msg"] != "hello" || rec[KeyRequestID] != "r1" {
			t.Errorf("record = %v", rec)
		}
	})
	t.Run("text is tint without color off a terminal", func(t *testing.T) {
		var buf bytes.Buffer
		log, err := New(&buf, "debug", FormatText)
		if err != nil {
			t.Fatal(err)
		}
		log.Debug("hello", "k", "v")
		out := buf.String()
		if !strings.Contains(out, "DBG hello k=v") || strings.Contains(out, "\x1b[") {
			t.Errorf("text output = %q", out)
		}
	})
	t.Run("unknown format", func(t *testing.T) {
		if _, err := New(&bytes.Buffer{}, "info", "xml"); err == nil {
			t.Error("want an error for format xml")
		}
	})
	t.Run("unknown level", func(t *testing.T) {
		if _, err := New(&bytes.Buffer{}, "loud", ""); err == nil {
			t.Error("want an error for level loud")
		}
	})
}

func TestMs(t *testing.T) {
	if a := Ms("d", 1234567*time.Nanosecond); a.Key != "d" || a.Value.Float64() != 1.23 {
		t.Errorf("Ms = %v", a)
	}
}
