// Package logging builds pdq's slog loggers: colored text from tint when a
// person is watching a terminal, JSON lines when a machine collects the
// output.
package logging

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/lmittmann/tint"
	"golang.org/x/term"
)

// Formats accepted by [New].
const (
	FormatAuto = ""     // text on a terminal, JSON otherwise
	FormatText = "text" // tint
	FormatJSON = "json"
)

// Keys of attributes that several components log, so that a request can be
// followed across them with one filter.
const (
	KeyRequestID = "request_id"
	KeyComponent = "component"
	KeyError     = "err"
)

// ParseLevel reads a level name: debug, info, warn (or warning) or error.
// The empty string is info.
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "info":
		return slog.LevelInfo, nil
	case "debug":
		return slog.LevelDebug, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("unknown log level %q (want debug, info, warn or error)", s)
}

// New returns a logger that writes to w at the named level in the named
// format (see [FormatAuto]).
func New(w io.Writer, level, format string) (*slog.Logger, error) {
	lvl, err := ParseLevel(level)
	if err != nil {
		return nil, err
	}
	tty := isTerminal(w)
	switch strings.ToLower(format) {
	case FormatAuto:
		if !tty {
			return slog.New(&lazy{h: slog.NewJSONHandler(w, &slog.HandlerOptions{Level: lvl})}), nil
		}
	case FormatText:
	case FormatJSON:
		return slog.New(&lazy{h: slog.NewJSONHandler(w, &slog.HandlerOptions{Level: lvl})}), nil
	default:
		return nil, fmt.Errorf("unknown log format %q (want text or json)", format)
	}
	return slog.New(&lazy{h: tint.NewTextHandler(w, &tint.Options{
		Level:      lvl,
		TimeFormat: time.TimeOnly + ".000",
		NoColor:    !tty,
	})}), nil
}

// lazy gives a logger's With attributes to its handler when the logger
// first writes a record, not when the logger is made. slog's handlers
// format them in WithAttrs, and pdq makes a logger per request and per job
// (with its request id) that mostly writes nothing: formatting them showed
// in pdq up's profiles (docs/benchmarks.md). A logger that
// writes calls WithAttrs once, with the same attributes, values resolved
// when they were given, as slog's handlers resolve them: the output is
// the same.
type lazy struct {
	h     slog.Handler
	attrs []slog.Attr // given after every group h has, not yet to h
	with  atomic.Pointer[slog.Handler]
}

func (l *lazy) Enabled(ctx context.Context, level slog.Level) bool { return l.h.Enabled(ctx, level) }

// WithAttrs starts from this logger's handler with its attributes when it
// has made it already (it wrote), so as not to format those again.
func (l *lazy) WithAttrs(attrs []slog.Attr) slog.Handler {
	if len(attrs) == 0 {
		return l
	}
	h, all := l.h, slices.Clip(l.attrs)
	if made := l.with.Load(); made != nil {
		h, all = *made, nil
	}
	all = slices.Grow(all, len(attrs))
	for _, a := range attrs {
		all = append(all, resolved(a))
	}
	return &lazy{h: h, attrs: all}
}

// WithGroup gives h the attributes first: they are outside the group.
func (l *lazy) WithGroup(name string) slog.Handler {
	if name == "" {
		return l
	}
	return &lazy{h: l.handler().WithGroup(name)}
}

func (l *lazy) Handle(ctx context.Context, r slog.Record) error { return l.handler().Handle(ctx, r) }

// handler is h with the attributes, made at the first call.
func (l *lazy) handler() slog.Handler {
	if len(l.attrs) == 0 {
		return l.h
	}
	if h := l.with.Load(); h != nil {
		return *h
	}
	h := l.h.WithAttrs(slices.Clone(l.attrs))
	l.with.CompareAndSwap(nil, &h) // two first calls make equal handlers
	return h
}

// resolved is a with its value's LogValuers resolved, in groups too.
func resolved(a slog.Attr) slog.Attr {
	a.Value = a.Value.Resolve()
	if a.Value.Kind() == slog.KindGroup {
		group := a.Value.Group()
		members := make([]slog.Attr, len(group))
		for i, m := range group {
			members[i] = resolved(m)
		}
		a.Value = slog.GroupValue(members...)
	}
	return a
}

// Discard returns a logger that drops everything, for tests that do not
// look at logs.
func Discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

// Ms is a duration attribute in milliseconds (two decimals), readable in
// both formats: slog's JSON handler would write nanoseconds.
func Ms(key string, d time.Duration) slog.Attr {
	return slog.Float64(key, math.Round(float64(d)/1e4)/100)
}

// Err is the attribute for an error, under one key everywhere.
func Err(err error) slog.Attr { return slog.Any(KeyError, err) }

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}
