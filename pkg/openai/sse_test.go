package openai

import (
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"
)

func TestSSEReader(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      string
		want    []string // data of each event
		names   []string // event names, when checked
		wantErr error    // how the stream ends; nil means io.EOF
	}{
		{name: "openai stream", in: "data: {\"a\":1}\n\ndata: [DONE]\n\n", want: []string{`{"a":1}`, "[DONE]"}},
		{name: "crlf", in: "data: x\r\n\r\ndata: y\r\n\r\n", want: []string{"x", "y"}},
		{name: "no space after colon", in: "data:x\n\n", want: []string{"x"}},
		{name: "multi-line data", in: "data: a\ndata: b\n\n", want: []string{"a\nb"}},
		{name: "comments and keep-alives skipped", in: ": ping\n\n: ping\ndata: x\n\n", want: []string{"x"}},
		{name: "event name and id", in: "event: error\nid: 7\ndata: x\n\n", want: []string{"x"}, names: []string{"error"}},
		{name: "empty data", in: "data:\n\n", want: []string{""}},
		{name: "blank lines between events", in: "\n\ndata: x\n\n\n", want: []string{"x"}},
		{name: "cut inside an event", in: "data: x\n\ndata: y\n", want: []string{"x"}, wantErr: io.ErrUnexpectedEOF},
		{name: "cut inside a line", in: "data: x\n\ndata: {\"a\"", want: []string{"x"}, wantErr: io.ErrUnexpectedEOF},
		{name: "empty stream", in: "", want: nil},
	} {
		for _, oneByte := range []bool{false, true} {
			var src io.Reader = strings.NewReader(tc.in)
			if oneByte {
				src = iotest.OneByteReader(src)
			}
			r := NewSSEReader(src)
			var got, names []string
			var err error
			for {
				var ev Event
				if ev, err = r.Next(); err != nil {
					break
				}
				got = append(got, string(ev.Data))
				names = append(names, ev.Name)
			}
			wantErr := tc.wantErr
			if wantErr == nil {
				wantErr = io.EOF
			}
			if !errors.Is(err, wantErr) {
				t.Errorf("%s (one byte %v): ended with %v, want %v", tc.name, oneByte, err, wantErr)
			}
			if strings.Join(got, "|") != strings.Join(tc.want, "|") || len(got) != len(tc.want) {
				t.Errorf("%s (one byte %v): events %q, want %q", tc.name, oneByte, got, tc.want)
			}
			if tc.names != nil && strings.Join(names, "|") != strings.Join(tc.names, "|") {
				t.Errorf("%s: names %q, want %q", tc.name, names, tc.names)
			}
		}
	}
}

// TestSSEReaderStreams checks that an event is returned as soon as it is
// complete, without waiting for the rest of the body.
func TestSSEReaderStreams(t *testing.T) {
	pr, pw := io.Pipe()
	defer pw.Close()
	go pw.Write([]byte("data: first\n\n")) // and then nothing until the test ends
	got := make(chan string, 1)
	go func() {
		ev, err := NewSSEReader(pr).Next()
		if err != nil {
			got <- "error: " + err.Error()
			return
		}
		got <- string(ev.Data)
	}()
	select {
	case s := <-got:
		if s != "first" {
			t.Errorf("got %q", s)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the first event was not returned while the body stayed open")
	}
}

func TestSSEReaderLimit(t *testing.T) {
	r := NewSSEReader(strings.NewReader("data: " + strings.Repeat("x", 100) + "\n\n"))
	r.max = 50
	if _, err := r.Next(); !errors.Is(err, ErrEventTooLarge) {
		t.Errorf("err = %v, want ErrEventTooLarge", err)
	}
	r = NewSSEReader(strings.NewReader(strings.Repeat("data: xxxxxxxxxx\n", 10) + "\n"))
	r.max = 50
	if _, err := r.Next(); !errors.Is(err, ErrEventTooLarge) {
		t.Errorf("many lines: err = %v, want ErrEventTooLarge", err)
	}
}

func TestSSEWriter(t *testing.T) {
	rec := httptest.NewRecorder()
	w := NewSSEWriter(rec)
	if w.Started() {
		t.Fatal("started before the first event")
	}
	if err := w.JSON(map[string]int{"a": 1}); err != nil {
		t.Fatal(err)
	}
	if err := w.Error(NewError(500, "boom")); err != nil {
		t.Fatal(err)
	}
	want := "data: {\"a\":1}\n\n" +
		"data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n" +
		"data: [DONE]\n\n"
	if rec.Body.String() != want {
		t.Errorf("body:\n%q\nwant\n%q", rec.Body.String(), want)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
		t.Errorf("Content-Type = %q", ct)
	}
	if !rec.Flushed || rec.Code != 200 {
		t.Errorf("flushed %v, code %d", rec.Flushed, rec.Code)
	}
}

// TestSSERoundTrip checks that what the writer writes, the reader reads.
func TestSSERoundTrip(t *testing.T) {
	rec := httptest.NewRecorder()
	w := NewSSEWriter(rec)
	payloads := []string{`{"x":"a b"}`, `{"y":[1,2]}`, `""`}
	for _, p := range payloads {
		if err := w.Data([]byte(p)); err != nil {
			t.Fatal(err)
		}
	}
	w.Done()
	r := NewSSEReader(rec.Body)
	for _, p := range payloads {
		ev, err := r.Next()
		if err != nil || string(ev.Data) != p {
			t.Fatalf("read %q, %v; want %q", ev.Data, err, p)
		}
	}
	if ev, err := r.Next(); err != nil || !ev.IsDone() {
		t.Fatalf("want [DONE], got %q, %v", ev.Data, err)
	}
	if _, err := r.Next(); err != io.EOF {
		t.Fatalf("want io.EOF at the end, got %v", err)
	}
}

// TestSSEReaderLongLine checks a line longer than the read buffer, which is
// read in pieces.
func TestSSEReaderLongLine(t *testing.T) {
	long := strings.Repeat("x", 100<<10)
	for _, oneByte := range []bool{false, true} {
		var src io.Reader = strings.NewReader("data: " + long + "\n\ndata: y\n\n")
		if oneByte {
			src = iotest.OneByteReader(src)
		}
		r := NewSSEReader(src)
		ev, err := r.Next()
		if err != nil || string(ev.Data) != long {
			t.Fatalf("one byte %v: got %d bytes, %v", oneByte, len(ev.Data), err)
		}
		if ev, err := r.Next(); err != nil || string(ev.Data) != "y" {
			t.Fatalf("one byte %v: second event %q, %v", oneByte, ev.Data, err)
		}
	}
}

func TestSSEReaderHasEvent(t *testing.T) {
	for _, tc := range []struct {
		stream string
		want   bool // after reading the first event
	}{
		{"data: a\n\ndata: b\n\n", true},
		{"data: a\n\ndata: b", false},
		{"data: a\n\n: ping\n\n", false},
		{"data: a\n\nevent: x\n\n", false},
		{"data: a\n\n\n\n", false},
		{"data: a\r\n\r\ndata: b\r\n\r\n", true},
		{"data: a\n\n: ping\n\ndata:b\n\n", true},
		{"data: a\n\ndatum: b\n\n", false},
	} {
		r := NewSSEReader(strings.NewReader(tc.stream))
		if _, err := r.Next(); err != nil {
			t.Fatalf("%q: %v", tc.stream, err)
		}
		// A strings.Reader is read whole into the buffer by the first Next.
		if got := r.HasEvent(); got != tc.want {
			t.Errorf("%q: HasEvent = %v, want %v", tc.stream, got, tc.want)
		}
	}
}

// countingListener counts the writes to the connections it accepts.
type countingListener struct {
	net.Listener
	writes atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, writes: &l.writes}, nil
}

type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// TestSSEWriterHeadersWithFirstEvent checks, on a real connection, that
// the status and headers go out in the first event's write, not in one of
// their own: a burst of events and [DONE] are three writes, the events
// with the headers, [DONE] (flushed as it is written), and the body's end
// as the handler returns.
func TestSSEWriterHeadersWithFirstEvent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := &countingListener{Listener: ln}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		w := NewSSEWriter(rw)
		for _, p := range []string{`{"a":1}`, `{"b":2}`} {
			if err := w.Write([]byte(p)); err != nil {
				t.Error(err)
			}
		}
		if err := w.Flush(); err != nil {
			t.Error(err)
		}
		if err := w.Done(); err != nil {
			t.Error(err)
		}
	}))
	srv.Listener = cl
	srv.Start()
	defer srv.Close()

	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || ct != "text/event-stream; charset=utf-8" {
		t.Fatalf("status %d, Content-Type %q", resp.StatusCode, ct)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if want := "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n"; string(body) != want {
		t.Fatalf("body %q, want %q", body, want)
	}
	if n := cl.writes.Load(); n != 3 {
		t.Errorf("%d writes to the connection, want 3: the headers with the events, [DONE], the body's end", n)
	}
}
