package openai

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// Done is the data of the event that ends an OpenAI stream.
var Done = []byte("[DONE]")

// SSEWriter writes Server-Sent Events in the framing vLLM and OpenAI use:
// "data: <payload>\n\n" per event, each flushed at once so tokens reach the
// client as they are made.
type SSEWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	started bool
	pending bool // written since the last flush
	buf     []byte
}

// NewSSEWriter wraps w. Headers are sent with the first event, so a handler
// can still answer with an error status until then.
func NewSSEWriter(w http.ResponseWriter) *SSEWriter {
	return &SSEWriter{w: w, rc: http.NewResponseController(w)}
}

// Started reports whether the status line and headers have been written:
// from then on the status cannot change.
func (s *SSEWriter) Started() bool { return s.started }

// start writes the 200 status and the event-stream headers. They go out
// with the first event's flush, in one write: a flush of the headers
// alone was a write to the client of its own for every stream.
func (s *SSEWriter) start() {
	if s.started {
		return
	}
	s.started = true
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	s.w.WriteHeader(http.StatusOK)
}

// Data writes one event whose data is payload, and flushes it. payload
// must not hold a newline: JSON from encoding/json never does.
func (s *SSEWriter) Data(payload []byte) error {
	if err := s.Write(payload); err != nil {
		return err
	}
	return s.Flush()
}

// Write writes one event without flushing it: a caller with more events at
// hand writes them all, then flushes once (one syscall, not one per token).
func (s *SSEWriter) Write(payload []byte) error {
	s.start()
	s.buf = append(s.buf[:0], "data: "...)
	s.buf = append(s.buf, payload...)
	s.buf = append(s.buf, '\n', '\n')
	if _, err := s.w.Write(s.buf); err != nil {
		return fmt.Errorf("write sse event: %w", err)
	}
	s.pending = true
	return nil
}

// Flush sends the events written since the last flush, if any.
func (s *SSEWriter) Flush() error {
	if !s.pending {
		return nil
	}
	s.pending = false
	if err := s.rc.Flush(); err != nil {
		return fmt.Errorf("flush sse event: %w", err)
	}
	return nil
}

// JSON writes v, encoded as JSON, as one event.
func (s *SSEWriter) JSON(v any) error {
	payload, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode sse event: %w", err)
	}
	return s.Data(payload)
}

// Error writes an in-stream error event followed by [DONE], as vLLM does once
// a stream has started and can no longer change its status.
func (s *SSEWriter) Error(e *Error) error {
	if err := s.JSON(ErrorResponse{Error: e}); err != nil {
		return err
	}
	return s.Done()
}

// Done writes the closing "data: [DONE]" event.
func (s *SSEWriter) Done() error { return s.Data(Done) }

// Event is one Server-Sent Event.
type Event struct {
	// Name is the event field, empty for the default "message" event.
	Name string
	// Data is the event's data; lines of a multi-line event are joined with
	// "\n".
	Data []byte
}

// IsDone reports whether the event is the closing [DONE] of an OpenAI stream.
func (e Event) IsDone() bool { return bytes.Equal(e.Data, Done) }

// ErrEventTooLarge is returned by [SSEReader.Next] for an event over the
// reader's limit.
var ErrEventTooLarge = errors.New("sse: event too large")

// DefaultMaxEventSize bounds one event, so a broken upstream cannot make a
// reader buffer without end.
const DefaultMaxEventSize = 16 << 20

// SSEReader reads Server-Sent Events one at a time from a stream, holding at
// most one event in memory.
type SSEReader struct {
	r   *bufio.Reader
	max int
}

// NewSSEReader reads events from r. Its 4 KiB buffer holds a token's chunk
// many times over; a longer line is gathered beyond it.
func NewSSEReader(r io.Reader) *SSEReader {
	return &SSEReader{r: bufio.NewReaderSize(r, 4<<10), max: DefaultMaxEventSize}
}

// HasEvent reports whether a whole event with data is already buffered:
// Next would return it without waiting for the stream. (Comments and
// blocks without data, which Next skips, do not count.)
func (s *SSEReader) HasEvent() bool {
	b, _ := s.r.Peek(s.r.Buffered())
	hasData := false
	for {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			return false
		}
		line := bytes.TrimSuffix(b[:i], []byte("\r"))
		b = b[i+1:]
		switch {
		case len(line) == 0 && hasData:
			return true
		case len(line) == 0:
		case bytes.HasPrefix(line, dataField) && (len(line) == len(dataField) || line[len(dataField)] == ':'):
			hasData = true
		}
	}
}

var dataField = []byte("data")

// Next returns the next event that has data. It returns io.EOF when the
// stream ends between events and io.ErrUnexpectedEOF when it ends inside
// one, which is how a dropped connection shows.
func (s *SSEReader) Next() (Event, error) {
	var (
		ev      Event
		data    []byte
		hasData bool
		partial bool
	)
	for {
		line, err := s.readLine()
		if err != nil {
			if errors.Is(err, io.EOF) {
				if partial {
					return Event{}, io.ErrUnexpectedEOF
				}
				return Event{}, io.EOF
			}
			return Event{}, err
		}
		if len(line) == 0 {
			if hasData {
				ev.Data = data
				return ev, nil
			}
			ev, partial = Event{}, false
			continue
		}
		partial = true
		field, value := line, []byte(nil)
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = line[:i], line[i+1:]
			value = bytes.TrimPrefix(value, []byte(" "))
		}
		switch string(field) {
		case "": // a comment line, ":..."
		case "data":
			if hasData {
				data = append(data, '\n')
			}
			if len(data)+len(value) > s.max {
				return Event{}, ErrEventTooLarge
			}
			data = append(data, value...)
			hasData = true
		case "event":
			ev.Name = string(value)
		}
	}
}

// readLine returns one line without its "\n" or "\r\n" terminator. A stream
// that ends inside a line gives io.ErrUnexpectedEOF. The line is valid only
// until the next read: Next copies what it keeps, so the usual line, one
// that fits the buffer, is not copied here. This runs once per token.
func (s *SSEReader) readLine() ([]byte, error) {
	chunk, err := s.r.ReadSlice('\n')
	line := chunk
	if errors.Is(err, bufio.ErrBufferFull) {
		line = append([]byte(nil), chunk...) // the buffer is about to be reused
		for errors.Is(err, bufio.ErrBufferFull) {
			if len(line) > s.max {
				return nil, ErrEventTooLarge
			}
			chunk, err = s.r.ReadSlice('\n')
			line = append(line, chunk...)
		}
	}
	if len(line) > s.max {
		return nil, ErrEventTooLarge
	}
	if err != nil {
		if errors.Is(err, io.EOF) && len(line) > 0 {
			return nil, io.ErrUnexpectedEOF
		}
		return nil, err
	}
	line = bytes.TrimSuffix(line, []byte("\n"))
	line = bytes.TrimSuffix(line, []byte("\r"))
	return line, nil
}
