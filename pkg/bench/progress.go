package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/term"
)

// IsTerminal reports whether w is a terminal, where a progress bar goes.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// progress is a tqdm-like bar: " 45%|████▌     | 450/1000 [00:05<00:06, 90.00it/s]",
// redrawn in place at most ten times a second.
//
// Each request's goroutine calls inc as it ends, any number at once; Run
// calls close once they are done.
type progress struct {
	// Set by newProgress, read without a lock.
	w     io.Writer
	total int
	start time.Time

	// mu guards the fields below, and the writes to w.
	mu     sync.Mutex
	done   int
	drawn  time.Time
	closed bool
}

func newProgress(w io.Writer, total int) *progress {
	p := &progress{w: w, total: total, start: time.Now()}
	p.draw()
	return p
}

// inc counts one finished request.
func (p *progress) inc() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if p.done == p.total || time.Since(p.drawn) >= 100*time.Millisecond {
		p.draw()
	}
}

// close draws the final state and ends the line.
func (p *progress) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.closed = true
		p.draw()
		fmt.Fprintln(p.w)
	}
}

func (p *progress) draw() {
	p.drawn = time.Now()
	elapsed := time.Since(p.start)
	frac := 0.0
	if p.total > 0 {
		frac = float64(p.done) / float64(p.total)
	}
	const width = 30
	eighths := int(frac * width * 8)
	bar := strings.Repeat("█", eighths/8)
	if eighths%8 > 0 && eighths/8 < width {
		bar += string(rune('█' + 8 - eighths%8)) // ▏▎▍▌▋▊▉ are U+258F down to U+2589
	}
	bar += strings.Repeat(" ", width-len([]rune(bar)))
	rate, remaining := "?", "?"
	if s := elapsed.Seconds(); p.done > 0 && s > 0 {
		r := float64(p.done) / s
		rate = fmt.Sprintf("%.2f", r)
		remaining = clock(time.Duration(float64(p.total-p.done) / r * float64(time.Second)))
	}
	fmt.Fprintf(p.w, "\r%3d%%|%s| %d/%d [%s<%s, %sit/s]", int(frac*100), bar, p.done, p.total, clock(elapsed), remaining, rate)
}

// clock is tqdm's MM:SS, or H:MM:SS past an hour.
func clock(d time.Duration) string {
	s := int(d.Seconds())
	if s >= 3600 {
		return fmt.Sprintf("%d:%02d:%02d", s/3600, s/60%60, s%60)
	}
	return fmt.Sprintf("%02d:%02d", s/60, s%60)
}
