package logging

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/lmittmann/tint"
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

// A lazy logger writes what the handler it wraps writes, for loggers made
// with any mix of With and WithGroup.
func TestLazyWritesTheSame(t *testing.T) {
	noTime := func(groups []string, a slog.Attr) slog.Attr {
		if len(groups) == 0 && a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	handlers := map[string]func(w io.Writer) slog.Handler{
		"json": func(w io.Writer) slog.Handler {
			return slog.NewJSONHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug, ReplaceAttr: noTime})
		},
		"text": func(w io.Writer) slog.Handler {
			return tint.NewTextHandler(w, &tint.Options{Level: slog.LevelDebug, NoColor: true, ReplaceAttr: noTime})
		},
	}
	loggers := map[string]func(l *slog.Logger) *slog.Logger{
		"plain":             func(l *slog.Logger) *slog.Logger { return l },
		"with":              func(l *slog.Logger) *slog.Logger { return l.With(KeyRequestID, "r1", "n", 2) },
		"with twice":        func(l *slog.Logger) *slog.Logger { return l.With(KeyRequestID, "r1").With("generation", 3) },
		"group after with":  func(l *slog.Logger) *slog.Logger { return l.With("a", 1).WithGroup("g").With("b", 2) },
		"group first":       func(l *slog.Logger) *slog.Logger { return l.WithGroup("g").With("b", 2) },
		"empty group":       func(l *slog.Logger) *slog.Logger { return l.With("a", 1).WithGroup("").With("b", 2) },
		"group attribute":   func(l *slog.Logger) *slog.Logger { return l.With(slog.Group("req", "id", "r1", "n", 1)) },
		"inline group":      func(l *slog.Logger) *slog.Logger { return l.With(slog.Group("", "id", "r1")) },
		"empty attribute":   func(l *slog.Logger) *slog.Logger { return l.With(slog.Attr{}, "a", 1) },
		"duplicate key":     func(l *slog.Logger) *slog.Logger { return l.With("a", 1).With("a", 2) },
		"siblings share":    func(l *slog.Logger) *slog.Logger { p := l.With("a", 1); p.With("b", 2); return p.With("c", 3) },
		"many attributes":   func(l *slog.Logger) *slog.Logger { return l.With("a", 1, "b", 2, "c", 3, "d", 4, "e", 5, "f", 6) },
		"nested groups":     func(l *slog.Logger) *slog.Logger { return l.WithGroup("g").With("a", 1).WithGroup("h").With("b", 2) },
		"with, no argument": func(l *slog.Logger) *slog.Logger { return l.With() },
		"made from a writer": func(l *slog.Logger) *slog.Logger {
			p := l.With("a", 1)
			p.Info("the parent writes first")
			return p.With("b", 2).WithGroup("g").With("c", 3)
		},
		// A LogValuer is resolved when it is given, as the handlers resolve
		// it, not when the logger first writes.
		"log valuer": func(l *slog.Logger) *slog.Logger {
			b := &box{n: 1}
			l = l.With("n", b)
			b.n = 2
			return l
		},
		"log valuer in group": func(l *slog.Logger) *slog.Logger {
			b := &box{n: 1}
			l = l.With(slog.Group("g", "n", b))
			b.n = 2
			return l
		},
	}
	for hname, h := range handlers {
		for lname, derive := range loggers {
			t.Run(hname+"/"+lname, func(t *testing.T) {
				var eager, deferred bytes.Buffer
				for _, l := range []*slog.Logger{derive(slog.New(h(&eager))), derive(slog.New(&lazy{h: h(&deferred)}))} {
					l.Info("one", "x", 1, "y", "two", "z", 3, "w", 4, "v", 5, "u", 6)
					l.Warn("two", slog.Group("grp", "k", "v"))
					l.Debug("three")
				}
				if eager.String() != deferred.String() {
					t.Errorf("lazy wrote\n%s\nthe handler alone\n%s", deferred.String(), eager.String())
				}
			})
		}
	}
}

// box is a LogValuer whose value is n when it is resolved.
type box struct{ n int }

func (b *box) LogValue() slog.Value { return slog.IntValue(b.n) }

// A lazy logger gives its attributes to its handler once, when it first
// writes, and never when it writes nothing.
func TestLazyGivesAttributesOnce(t *testing.T) {
	h := &countingHandler{Handler: slog.NewJSONHandler(io.Discard, nil)}
	root := slog.New(&lazy{h: h})
	root.With("a", 1).Debug("below the level")
	root.With("a", 1).Info("")
	if h.withAttrs != 0 {
		t.Errorf("WithAttrs called %d times by loggers that wrote nothing", h.withAttrs)
	}
	l := root.With("a", 1).With("b", 2)
	for range 3 {
		l.Warn("written")
	}
	if h.withAttrs != 1 || h.given != 2 {
		t.Errorf("WithAttrs called %d times with %d attributes by a logger that wrote three records, want once with 2", h.withAttrs, h.given)
	}
	// A logger made from one that wrote gives only its own.
	l.With("c", 3).Warn("written")
	if h.withAttrs != 2 || h.given != 3 {
		t.Errorf("WithAttrs called %d times with %d attributes in all, want twice with 3", h.withAttrs, h.given)
	}
}

// countingHandler counts WithAttrs calls; its records go nowhere below
// warn.
type countingHandler struct {
	slog.Handler
	withAttrs, given int
}

func (h *countingHandler) Enabled(_ context.Context, level slog.Level) bool {
	return level >= slog.LevelWarn
}

func (h *countingHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	h.withAttrs++
	h.given += len(attrs)
	return h
}

// BenchmarkWithUnwritten is a logger made per job that writes nothing, as
// at level warn.
func BenchmarkWithUnwritten(b *testing.B) {
	for _, lazily := range []bool{false, true} {
		b.Run(map[bool]string{false: "eager", true: "lazy"}[lazily], func(b *testing.B) {
			var h slog.Handler = slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn})
			if lazily {
				h = &lazy{h: h}
			}
			root := slog.New(h).With(KeyComponent, "prefill", "engine", "http://127.0.0.1:8100")
			b.ReportAllocs()
			for b.Loop() {
				l := root.With(KeyRequestID, "bench-0123456789abcdef", "generation", 1, "attempt", 1)
				l.Info("not written")
			}
		})
	}
}
