package vllm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
)

// vLLM's scheduler gauges, on its Prometheus /metrics.
const (
	metricRunning = "vllm:num_requests_running"
	metricWaiting = "vllm:num_requests_waiting"
)

// ErrNoLoad means the engine does not report its load: its /metrics is
// missing, or lacks vLLM's scheduler gauges.
var ErrNoLoad = errors.New("the engine reports no load (no vllm:num_requests_running on /metrics)")

// Load is what an engine's scheduler holds now: requests running (in the
// batch) and waiting (queued for a seat, or for their KV to arrive).
type Load struct {
	Running, Waiting int
}

// Load reads the engine's load from its /metrics.
func (c *Client) Load(ctx context.Context) (Load, error) {
	resp, err := c.Do(ctx, http.MethodGet, "/metrics", nil)
	if err != nil {
		return Load{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 400 && resp.StatusCode < 500 {
		// Not there, or not for us: asking again soon will not change it.
		io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return Load{}, fmt.Errorf("get /metrics: status %d: %w", resp.StatusCode, ErrNoLoad)
	}
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return Load{}, fmt.Errorf("get /metrics: status %d", resp.StatusCode)
	}
	return parseLoad(io.LimitReader(resp.Body, 16<<20))
}

// parseLoad reads the scheduler gauges from Prometheus text, summed over
// their series (vLLM labels them by model and, with data parallelism, by
// engine). It reads only the two lines' values, not the whole exposition:
// vLLM's /metrics is mostly histograms, and a worker reads it often.
func parseLoad(r io.Reader) (Load, error) {
	var l Load
	seen := false
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20) // from the scanner's small first buffer: most lines are short
	for sc.Scan() {
		line := sc.Bytes() // no copy: most lines are not read past their name
		var n *int
		var rest []byte
		if r, ok := sample(line, metricRunning); ok {
			n, rest = &l.Running, r
		} else if r, ok := sample(line, metricWaiting); ok {
			n, rest = &l.Waiting, r
		} else {
			continue
		}
		if rest[0] == '{' {
			rest = rest[bytes.LastIndexByte(rest, '}')+1:]
		}
		fields := bytes.Fields(rest)
		if len(fields) == 0 {
			return Load{}, fmt.Errorf("get /metrics: no value in %q", line)
		}
		v, err := strconv.ParseFloat(string(fields[0]), 64)
		if err != nil {
			return Load{}, fmt.Errorf("get /metrics: %q: %w", line, err)
		}
		*n += int(v)
		seen = true
	}
	if err := sc.Err(); err != nil {
		return Load{}, fmt.Errorf("get /metrics: %w", err)
	}
	if !seen {
		return Load{}, ErrNoLoad
	}
	return l, nil
}

// sample reports whether line is a sample of the metric name (not a
// comment, nor a metric whose name only starts with it), and returns what
// follows the name: labels, value and time.
func sample(line []byte, name string) ([]byte, bool) {
	if len(line) <= len(name) || string(line[:len(name)]) != name {
		return nil, false
	}
	rest := line[len(name):]
	return rest, rest[0] == '{' || rest[0] == ' '
}
