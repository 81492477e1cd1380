package affinity

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/openai"
)

func hashesOf(s string) []uint64 {
	var c Chunker
	c.WriteString(s)
	return c.Hashes()
}

func TestChunker(t *testing.T) {
	a := strings.Repeat("a", 3*ChunkBytes+10)
	h := hashesOf(a)
	if len(h) != 3 {
		t.Fatalf("%d hashes of 3 chunks and a bit, want 3 (full chunks only)", len(h))
	}
	var pieces Chunker
	for _, p := range []string{a[:5], a[5:700], a[700:]} {
		pieces.WriteString(p)
	}
	if fmt.Sprint(pieces.Hashes()) != fmt.Sprint(h) {
		t.Error("the same text written in pieces hashes otherwise")
	}
	b := a[:ChunkBytes] + strings.Repeat("b", 2*ChunkBytes)
	hb := hashesOf(b)
	if hb[0] != h[0] || hb[1] == h[1] || hb[2] == h[2] {
		t.Error("want the first chunk equal, the chain different after the first difference")
	}
	var big Chunker
	big.WriteString(strings.Repeat("x", (MaxChunks+10)*ChunkBytes))
	if len(big.Hashes()) != MaxChunks {
		t.Errorf("%d hashes of a long prompt, want at most %d", len(big.Hashes()), MaxChunks)
	}
}

func TestPromptHashes(t *testing.T) {
	doc := strings.Repeat("the same long document ", 40)
	decode := func(endpoint openai.Endpoint, body string) *openai.Request {
		req, err := openai.DecodeRequest(endpoint, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return req
	}
	turn1 := decode(openai.Chat, `{"model":"m","messages":[{"role":"user","content":"`+doc+` question one"}]}`)
	turn2 := decode(openai.Chat, `{"model":"m","messages":[{"role":"user","content":"`+doc+` question one"},{"role":"assistant","content":"an answer"},{"role":"user","content":"question two"}]}`)
	h1, h2 := PromptHashes(openai.Chat, turn1), PromptHashes(openai.Chat, turn2)
	if len(h1) == 0 || len(h2) < len(h1) {
		t.Fatalf("%d and %d chunks", len(h1), len(h2))
	}
	for i := range h1 {
		if h1[i] != h2[i] {
			t.Fatalf("turn 2 differs from turn 1 at chunk %d: a conversation's next turn must extend its prefix", i)
		}
	}
	parts := decode(openai.Chat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"`+doc+` question one"}]}]}`)
	if fmt.Sprint(PromptHashes(openai.Chat, parts)) != fmt.Sprint(h1) {
		t.Error("a text part and a string content hash otherwise")
	}
	cmpl := decode(openai.Completions, `{"model":"m","prompt":"`+doc+`"}`)
	if len(PromptHashes(openai.Completions, cmpl)) != len(doc)/ChunkBytes {
		t.Error("a completions prompt's chunks")
	}
}

func TestIndex(t *testing.T) {
	ix := NewIndex(4)
	a := hashesOf(strings.Repeat("a", 3*ChunkBytes))
	ix.Record(a, "e1")
	if got := ix.Matched(a, "e1"); got != 3 {
		t.Errorf("matched %d, want 3", got)
	}
	if got := ix.Matched(a, "e2"); got != 0 {
		t.Errorf("e2 matched %d, want 0", got)
	}
	ix.Record(a[:1], "e2")
	if got := ix.Matched(a, "e2"); got != 1 {
		t.Errorf("e2 matched %d, want 1", got)
	}
	b := hashesOf(strings.Repeat("b", 2*ChunkBytes))
	ix.Record(b, "e3") // 5 chunks in a 4-chunk index: a's oldest goes
	if ix.Len() != 4 {
		t.Errorf("%d chunks remembered, want 4", ix.Len())
	}
	if got := ix.Matched(a, "e1"); got != 1 {
		t.Errorf("after eviction e1 matched %d of a, want 1 (its first chunk, used since)", got)
	}
}

func TestChoose(t *testing.T) {
	ix := NewIndex(1000)
	doc := hashesOf(strings.Repeat("d", 10*ChunkBytes))
	ix.Record(doc, "e2")
	engines := []Engine{{Key: "e1", Slots: 4}, {Key: "e2", Slots: 4}, {Key: "e3", Slots: 4}}
	for _, tc := range []struct {
		name string
		busy [3]int
		want string
	}{
		{"the engine holding the prefix", [3]int{0, 0, 0}, "e2"},
		{"even with some load", [3]int{0, 2, 0}, "e2"},
		{"not when it is full and others idle", [3]int{0, 4, 0}, ""},
	} {
		es := append([]Engine(nil), engines...)
		for i := range es {
			es[i].Busy = tc.busy[i]
		}
		got := Choose(ix, doc, es)
		if tc.want != "" && got.Engine != tc.want || tc.want == "" && got.Engine == "e2" {
			t.Errorf("%s: chose %+v", tc.name, got)
		}
	}
	// A new prefix goes where rendezvous hashing puts it, whatever the
	// order of the engines; an engine that leaves moves only its own.
	moved := 0
	for i := range 200 {
		h := hashesOf(fmt.Sprintf("%0*d", ChunkBytes, i))
		all := Choose(NewIndex(1), h, engines).Engine
		if rev := Choose(NewIndex(1), h, []Engine{engines[2], engines[1], engines[0]}).Engine; rev != all {
			t.Fatalf("prefix %d: %s, or %s with the engines listed backwards", i, all, rev)
		}
		without := Choose(NewIndex(1), h, engines[:2]).Engine
		if all != "e3" && without != all {
			moved++
		}
	}
	if moved != 0 {
		t.Errorf("%d prefixes not on the engine that left moved", moved)
	}
	if Choose(ix, doc, nil).Engine != "" {
		t.Error("a choice among no engines")
	}
}

// TestPlacerCached: the share of a prompt an engine was sent from the
// start, which the fair queue leaves out of the prompt's load; nothing,
// and no hashing, with fewer than two engines to choose between.
func TestPlacerCached(t *testing.T) {
	workers := []dispatcher.WorkerInfo{{Engine: "http://a", Affinity: true, Slots: 4}, {Engine: "http://b", Affinity: true, Slots: 4}}
	p := NewPlacer()
	hashes := func(text string) func() []uint64 { return func() []uint64 { return hashesOf(text) } }
	doc := strings.Repeat("the same long document ", 100) // 2,300 bytes: 8 full chunks
	if got := p.Cached(func() []uint64 { t.Fatal("hashed for one engine"); return nil }, workers[:1]); got != 0 {
		t.Errorf("one engine: cached %d bytes, want 0", got)
	}
	if got := p.Cached(hashes(doc), workers); got != 0 {
		t.Errorf("a prompt never sent: cached %d bytes, want 0", got)
	}
	_, _, done := p.Place(hashes(doc), workers)
	done()
	if got := p.Cached(hashes(doc), workers); got != 0 {
		t.Errorf("a prompt placed but not sent: cached %d bytes, want 0", got)
	}
	_, sent, done := p.Place(hashes(doc), workers)
	sent()
	done()
	if got := p.Cached(hashes(doc), workers); got != 8*ChunkBytes {
		t.Errorf("the same prompt again: cached %d bytes, want its 8 whole chunks, %d", got, 8*ChunkBytes)
	}
	if got := p.Cached(hashes(doc[:len(doc)/2]+strings.Repeat("another ending ", 80)), workers); got != 4*ChunkBytes {
		t.Errorf("a prompt sharing its first 1,150 bytes: cached %d bytes, want 4 whole chunks, %d", got, 4*ChunkBytes)
	}
	if got := p.Cached(hashes(doc+strings.Repeat("a long new ending ", 1000)), workers); got != 8*ChunkBytes {
		t.Errorf("the prompt with a long new ending: cached %d bytes, want the 8 chunks sent, %d", got, 8*ChunkBytes)
	}
}

// TestDecodePlacerBalance: a decode engine that holds a prompt keeps
// getting it while it runs fewer than decodeBalance decodes more than the
// least loaded engine, whatever its worker's slots; then the least loaded
// gets it. A prefill Placer counts load as a share of the worker's slots.
func TestDecodePlacerBalance(t *testing.T) {
	workers := []dispatcher.WorkerInfo{{Engine: "http://a", Affinity: true, Slots: 64}, {Engine: "http://b", Affinity: true, Slots: 64}}
	doc := strings.Repeat("the same long document ", 100)
	hashes := func() []uint64 { return hashesOf(doc) }
	for _, tc := range []struct {
		name   string
		placer *Placer
		stays  int // placements on the engine that holds the prompt, of 64
	}{
		{"decode", NewDecodePlacer(), decodeBalance},
		{"prefill", NewPlacer(), 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			first, sent, _ := tc.placer.Place(hashes, workers)
			sent() // running from here on: never done
			stays := 1
			for range 63 {
				if e, _, _ := tc.placer.Place(hashes, workers); e == first {
					stays++
				} else {
					break
				}
			}
			if stays != tc.stays {
				t.Errorf("the engine holding the prompt got %d placements in a row, want %d", stays, tc.stays)
			}
		})
	}
}

// TestPlacerLearning: a prompt new to every engine prefers none, and is
// recorded where its prefill ran, once told: the same prompt then prefers
// that engine. A prompt an engine holds is placed as Place does; an
// engine not among the workers is not learned.
func TestPlacerLearning(t *testing.T) {
	workers := []dispatcher.WorkerInfo{{Engine: "http://a", Affinity: true, Slots: 4}, {Engine: "http://b", Affinity: true, Slots: 4}}
	a, b := dispatcher.EngineKey("http://a"), dispatcher.EngineKey("http://b")
	p := NewPlacer()
	hashes := func(text string) func() []uint64 { return func() []uint64 { return hashesOf(text) } }
	doc := strings.Repeat("a document new to every engine ", 100)

	engine, _, _, learn := p.PlaceLearning(hashes(doc), workers)
	if engine != "" || learn == nil {
		t.Fatalf("a new prompt: prefers %q, learn %v; want no engine, and a learn", engine, learn != nil)
	}
	if len(p.busy) != 0 {
		t.Errorf("a prompt placed nowhere counted busy: %v", p.busy)
	}
	learn("e-not-a-worker")
	if n := p.index.Matched(hashesOf(doc), "e-not-a-worker"); n != 0 {
		t.Errorf("learned at an engine that is no worker's: %d chunks recorded there", n)
	}
	learn(b)
	engine, sent, done, learn := p.PlaceLearning(hashes(doc), workers)
	if engine != b || learn != nil {
		t.Errorf("the prompt again, once run on b: prefers %q (learn %v), want %q", engine, learn != nil, b)
	}
	sent()
	done()
	// Place, as without learning: a new prompt still gets an engine.
	if engine, _, _ := p.Place(hashes(strings.Repeat("another new one ", 100)), workers); engine != a && engine != b {
		t.Errorf("Place of a new prompt: %q, want an engine", engine)
	}
}
