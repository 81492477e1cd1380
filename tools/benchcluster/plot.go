package main

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"strconv"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// A plot per workload: goodput against the request rate on the left, TTFT
// p99 (log scale) on the right, one line per router. Drawn with the
// standard library's image packages and x/image's fixed 7x13 font, so that
// the tool needs no plotting library.

// line is one router's figures.
type line struct {
	name  string
	color color.RGBA
	x, y  []float64
}

var routerColors = map[string]color.RGBA{
	"pdq":       {0x1f, 0x77, 0xb4, 0xff},
	"pdq-noaff": {0x94, 0x67, 0xbd, 0xff},
	"rr":        {0xff, 0x7f, 0x0e, 0xff},
	"ll":        {0x2c, 0xa0, 0x2c, 0xff},
}

// panel is one chart of the picture.
type panel struct {
	title, xLabel string
	lines         []line
	logY          bool
	// hline is a dashed horizontal line (the SLO), 0 for none.
	hline      float64
	hlineLabel string
}

const (
	panelW, panelH = 560, 420
	marginL        = 70
	marginR        = 20
	marginT        = 40
	marginB        = 50
)

var (
	black = color.RGBA{0, 0, 0, 0xff}
	grey  = color.RGBA{0xdd, 0xdd, 0xdd, 0xff}
	dark  = color.RGBA{0x66, 0x66, 0x66, 0xff}
)

// writePlot draws the panels side by side, a title above them and the
// legend below, into a PNG at path.
func writePlot(path, title string, panels []panel) error {
	const titleH, legendH = 30, 30
	img := image.NewRGBA(image.Rect(0, 0, panelW*len(panels), titleH+panelH+legendH))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	text(img, 10, 20, title, black)
	for i, p := range panels {
		p.draw(img, image.Rect(i*panelW, titleH, (i+1)*panelW, titleH+panelH))
	}
	if len(panels) > 0 {
		x := 10
		for _, l := range panels[0].lines {
			y := titleH + panelH + 15
			for dx := range 20 {
				dot(img, x+dx, y, 2, l.color)
			}
			text(img, x+26, y+4, l.name, black)
			x += 26 + 7*len(l.name) + 24
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func (p panel) draw(img *image.RGBA, r image.Rectangle) {
	plot := image.Rect(r.Min.X+marginL, r.Min.Y+marginT, r.Max.X-marginR, r.Max.Y-marginB)
	text(img, plot.Min.X, r.Min.Y+20, p.title, black)
	text(img, plot.Min.X+(plot.Dx()-7*len(p.xLabel))/2, r.Max.Y-12, p.xLabel, black)

	var xs, ys []float64
	for _, l := range p.lines {
		xs = append(xs, l.x...)
		for _, y := range l.y {
			if !math.IsNaN(y) && !math.IsInf(y, 0) && (!p.logY || y > 0) {
				ys = append(ys, y)
			}
		}
	}
	if p.hline > 0 {
		ys = append(ys, p.hline)
	}
	if len(xs) == 0 || len(ys) == 0 {
		text(img, plot.Min.X+10, plot.Min.Y+20, "no data", black)
		return
	}
	xMax := niceCeil(maxOf(xs) * 1.05)
	var yScale func(float64) float64
	var yTicks []float64
	if p.logY {
		lo := math.Pow(10, math.Floor(math.Log10(minOf(ys))))
		hi := math.Pow(10, math.Ceil(math.Log10(maxOf(ys)*1.05)))
		if hi/lo < 10 {
			hi = lo * 10
		}
		yScale = func(y float64) float64 { return math.Log10(y/lo) / math.Log10(hi/lo) }
		for d := lo; d <= hi*1.0001; d *= 10 {
			for _, m := range []float64{1, 2, 5} {
				if d*m <= hi*1.0001 {
					yTicks = append(yTicks, d*m)
				}
			}
		}
	} else {
		step := niceStep(maxOf(ys) * 1.1 / 5)
		hi := math.Ceil(maxOf(ys)*1.1/step) * step
		yScale = func(y float64) float64 { return y / hi }
		for y := 0.0; y <= hi*1.0001; y += step {
			yTicks = append(yTicks, y)
		}
	}
	px := func(x float64) int { return plot.Min.X + int(math.Round(x/xMax*float64(plot.Dx()))) }
	py := func(y float64) int { return plot.Max.Y - int(math.Round(yScale(y)*float64(plot.Dy()))) }

	for _, y := range yTicks {
		yy := py(y)
		hlineAt(img, plot.Min.X, plot.Max.X, yy, grey)
		label := tickLabel(y)
		text(img, plot.Min.X-8-7*len(label), yy+4, label, black)
	}
	xStep := niceStep(xMax / 6)
	for x := 0.0; x <= xMax*1.0001; x += xStep {
		xx := px(x)
		vlineAt(img, xx, plot.Min.Y, plot.Max.Y, grey)
		label := tickLabel(x)
		text(img, xx-7*len(label)/2, plot.Max.Y+18, label, black)
	}
	hlineAt(img, plot.Min.X, plot.Max.X, plot.Max.Y, black)
	vlineAt(img, plot.Min.X, plot.Min.Y, plot.Max.Y, black)
	if p.hline > 0 {
		yy := py(p.hline)
		for x := plot.Min.X; x < plot.Max.X; x += 8 {
			hlineAt(img, x, min(x+4, plot.Max.X), yy, dark)
		}
		text(img, plot.Max.X-7*len(p.hlineLabel)-4, yy-4, p.hlineLabel, dark)
	}
	for _, l := range p.lines {
		prevX, prevY, have := 0, 0, false
		for i := range l.x {
			y := l.y[i]
			if math.IsNaN(y) || math.IsInf(y, 0) || p.logY && y <= 0 {
				have = false
				continue
			}
			x1, y1 := px(l.x[i]), py(y)
			if have {
				segment(img, prevX, prevY, x1, y1, l.color)
			}
			for dx := -3; dx <= 3; dx++ {
				for dy := -3; dy <= 3; dy++ {
					img.Set(x1+dx, y1+dy, l.color)
				}
			}
			prevX, prevY, have = x1, y1, true
		}
	}
}

func maxOf(v []float64) float64 {
	m := v[0]
	for _, x := range v {
		m = math.Max(m, x)
	}
	return m
}

func minOf(v []float64) float64 {
	m := v[0]
	for _, x := range v {
		m = math.Min(m, x)
	}
	return m
}

// niceStep is the 1, 2 or 5 times a power of ten nearest above x.
func niceStep(x float64) float64 {
	if x <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= x {
			return m * p
		}
	}
	return 10 * p
}

func niceCeil(x float64) float64 {
	s := niceStep(x / 5)
	return math.Ceil(x/s) * s
}

func tickLabel(v float64) string {
	if v >= 1000 && math.Mod(v, 1000) == 0 {
		return strconv.FormatFloat(v/1000, 'g', -1, 64) + "k"
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}

func text(img *image.RGBA, x, y int, s string, c color.Color) {
	d := font.Drawer{Dst: img, Src: image.NewUniform(c), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

func hlineAt(img *image.RGBA, x0, x1, y int, c color.Color) {
	for x := x0; x <= x1; x++ {
		img.Set(x, y, c)
	}
}

func vlineAt(img *image.RGBA, x, y0, y1 int, c color.Color) {
	for y := y0; y <= y1; y++ {
		img.Set(x, y, c)
	}
}

func dot(img *image.RGBA, x, y, r int, c color.Color) {
	for dx := -r / 2; dx <= r/2; dx++ {
		for dy := -r / 2; dy <= r/2; dy++ {
			img.Set(x+dx, y+dy, c)
		}
	}
}

// segment draws a line two pixels wide.
func segment(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	n := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= n; i++ {
		x := x0 + (x1-x0)*i/n
		y := y0 + (y1-y0)*i/n
		dot(img, x, y, 2, c)
	}
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// plotWorkload writes the workload's plot into dir and returns its path.
func plotWorkload(dir string, p plan, rs []result, routers []router) (string, error) {
	var goodput, ttft []line
	for _, r := range routers {
		g := line{name: r.name, color: routerColors[r.key]}
		t := g
		for _, rate := range sweepRates(rs, p.w.key) {
			x, ok := find(rs, p.w.key, "", r.key, rate)
			if !ok {
				continue
			}
			g.x, g.y = append(g.x, rate), append(g.y, x.Goodput)
			t.x, t.y = append(t.x, rate), append(t.y, float64(x.TTFT99))
		}
		if len(g.x) > 0 {
			goodput, ttft = append(goodput, g), append(ttft, t)
		}
	}
	xLabel := "request rate (" + p.w.unit() + ")"
	path := fmt.Sprintf("%s/bench-cluster-%s.png", dir, p.w.key)
	return path, writePlot(path, fmt.Sprintf("make bench-cluster: %s (SLO %s)", p.w.title, p.slo), []panel{
		{title: "goodput (req/s meeting the SLO)", xLabel: xLabel, lines: goodput},
		{title: "TTFT p99 (ms, log scale)", xLabel: xLabel, lines: ttft, logY: true, hline: p.slo.TTFT, hlineLabel: "SLO"},
	})
}
