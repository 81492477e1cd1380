package tokenizer

import (
	"encoding/binary"
	"hash/fnv"
)

// BlockHashes names each full block of blockSize token ids, as vLLM's
// prefix cache does: a block's hash covers the hash of the block before
// it, its own token ids and the LoRA adapter ("" for the base model), so
// equal hashes mean equal prefixes up to that block. vLLM hashes with
// sha256 (or its builtin hash) over the same chain; the hash function
// differs, what matches does not. A partial last block is not named, as
// vLLM caches full blocks only. No hash is 0.
func BlockHashes(ids []int, adapter string, blockSize int) []uint64 {
	if blockSize < 1 {
		return nil
	}
	out := make([]uint64, len(ids)/blockSize)
	var parent uint64
	var buf [8]byte
	for i := range out {
		h := fnv.New64a()
		binary.LittleEndian.PutUint64(buf[:], parent)
		h.Write(buf[:])
		for _, id := range ids[i*blockSize : (i+1)*blockSize] {
			binary.LittleEndian.PutUint64(buf[:], uint64(id))
			h.Write(buf[:])
		}
		h.Write([]byte(adapter))
		parent = h.Sum64()
		if parent == 0 {
			parent = 1
		}
		out[i] = parent
	}
	return out
}
