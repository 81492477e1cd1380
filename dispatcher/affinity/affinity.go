// Package affinity picks, for each request, the engine whose prefix cache
// most likely holds its prompt's beginning, without a tokenizer, and
// weighs that against the engines' load.
//
// A prompt's text (a completions prompt, or a chat's messages with their
// roles) is cut into chunks of ChunkBytes bytes, each named by a hash
// chained over the chunks before it, as vLLM names its KV blocks: equal
// chunk hashes mean equal text up to there. The gateway keeps an Index of
// which engines it sent which chunks to; a new request's score on an
// engine is the share of its chunks that engine holds from the start,
// less the engine's load (its share of busy slots). Byte chunks are not
// vLLM's token blocks: 256 bytes are about 64 tokens, or 4 blocks of 16,
// and a prefix that ends inside a chunk is not counted. What matters for
// routing is only which engine holds the longer prefix, which the chunks
// tell as well as the blocks would; the last partial chunk, and a chat
// template's own tokens, are all the difference.
package affinity

import (
	"encoding/binary"
	"hash/fnv"
)

// ChunkBytes is the bytes of text a chunk hash covers; MaxChunks bounds
// the text looked at, 128 KiB: a prompt that shares more with another
// shares enough to route by.
const (
	ChunkBytes = 256
	MaxChunks  = 512
)

// Chunker builds a prompt's chunk hashes from its text, appended in
// pieces.
type Chunker struct {
	hashes  []uint64
	pending []byte
	parent  uint64
}

// Write appends text to the prompt, and reports false once the chunks are
// all taken (the rest of the prompt is not looked at).
func (c *Chunker) Write(text []byte) bool {
	for len(text) > 0 && len(c.hashes) < MaxChunks {
		n := min(ChunkBytes-len(c.pending), len(text))
		c.pending = append(c.pending, text[:n]...)
		text = text[n:]
		if len(c.pending) == ChunkBytes {
			c.hashes = append(c.hashes, c.chain(c.pending))
			c.pending = c.pending[:0]
		}
	}
	return len(c.hashes) < MaxChunks
}

// WriteString is Write of a string.
func (c *Chunker) WriteString(s string) bool { return c.Write([]byte(s)) }

// Hashes are the hashes of the full chunks written: a partial last chunk
// is not named, as vLLM caches only full blocks.
func (c *Chunker) Hashes() []uint64 { return c.hashes }

func (c *Chunker) chain(chunk []byte) uint64 {
	h := fnv.New64a()
	var buf [8]byte
	binary.LittleEndian.PutUint64(buf[:], c.parent)
	h.Write(buf[:])
	h.Write(chunk)
	c.parent = h.Sum64()
	return c.parent
}
