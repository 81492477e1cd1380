package affinity

import (
	"hash/fnv"
)

// Engine is an engine a job may go to: its key (dispatcher.EngineKey), how many jobs
// it runs at once, and how many it has now.
type Engine struct {
	Key   string
	Slots int
	Busy  int
}

// Choice is where a job should go first, and why.
type Choice struct {
	// Engine is the preferred engine's key; empty when there is no engine
	// to prefer.
	Engine string
	// Matched is how many of the prompt's chunks that engine was sent.
	Matched int
}

// Choose scores each engine by the share of the prompt's chunks it holds
// from the start, less its load (its busy share of its slots), and picks
// the best. Ties go to the less loaded engine, then to the one whose key
// hashes highest with the prompt's first chunk (rendezvous hashing), so
// that a new prefix's place does not depend on the order engines are
// listed in, and an engine that joins or leaves moves only the prefixes
// it wins or held.
func Choose(ix *Index, hashes []uint64, engines []Engine) Choice {
	if len(engines) == 0 {
		return Choice{}
	}
	var seed uint64
	if len(hashes) > 0 {
		seed = hashes[0]
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	best, bestScore, bestLoad, bestRank := Choice{}, 0.0, 0.0, uint64(0)
	for i, e := range engines {
		matched := ix.matchedLocked(hashes, e.Key)
		l := load(e)
		score := -l
		if len(hashes) > 0 {
			score += float64(matched) / float64(len(hashes))
		}
		rank := rendezvous(seed, e.Key)
		better := score > bestScore || score == bestScore && (l < bestLoad || l == bestLoad && rank > bestRank)
		if i == 0 || better {
			best, bestScore, bestLoad, bestRank = Choice{Engine: e.Key, Matched: matched}, score, l, rank
		}
	}
	return best
}

func load(e Engine) float64 {
	if e.Slots <= 0 {
		return 1
	}
	return float64(e.Busy) / float64(e.Slots)
}

func rendezvous(seed uint64, key string) uint64 {
	h := fnv.New64a()
	var buf [8]byte
	for i := range buf {
		buf[i] = byte(seed >> (8 * i))
	}
	h.Write(buf[:])
	h.Write([]byte(key))
	return h.Sum64()
}
