package bench

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
)

// MultiTurnDataset makes conversations as vLLM's multi-turn benchmark
// (benchmarks/multi_turn, generate_conversations) makes them, with
// constant lengths: Turns user messages of UserLen words, each answered
// with OutputLen tokens. The first user message starts with CommonPrefixLen
// words shared by every conversation (a system prompt) and PrefixLen words
// of its own (a document). Each turn's request carries the whole
// conversation so far, the model's actual answers included, so that it
// extends the previous turn's prompt: a cache that kept that prompt
// computes only the answer and the new message.
type MultiTurnDataset struct {
	Turns, CommonPrefixLen, PrefixLen, UserLen, OutputLen int
	Seed                                                  uint64
}

// Message is one message of a conversation's history.
type Message struct {
	Role, Text string
}

// Sample makes n conversations, as requests in conversation-major order:
// request c×Turns+k is turn k of conversation c, with id
// <prefix><c>-<k>. The history a turn carries is filled in as the
// conversation runs.
func (d MultiTurnDataset) Sample(n int, prefix string) ([]SampleRequest, error) {
	if d.Turns < 1 || d.UserLen < 1 || d.OutputLen < 1 || d.PrefixLen < 0 || d.CommonPrefixLen < 0 {
		return nil, fmt.Errorf("%w: --multi-turn-turns, --multi-turn-user-len and --multi-turn-output-len must be at least 1, the prefix lengths not negative", ErrInvalid)
	}
	rng := rand.New(rand.NewPCG(d.Seed, 0x636f6e76)) // "conv"
	words := func(k int) []string {
		w := make([]string, k)
		for i := range w {
			w[i] = vocabulary[rng.IntN(len(vocabulary))]
		}
		return w
	}
	common := words(d.CommonPrefixLen)
	reqs := make([]SampleRequest, 0, n*d.Turns)
	for c := range n {
		for k := range d.Turns {
			msg := words(d.UserLen)
			if k == 0 {
				msg = append(append(append([]string{}, common...), words(d.PrefixLen)...), msg...)
			}
			reqs = append(reqs, SampleRequest{
				Prompt:       strings.Join(msg, " "),
				PromptLen:    len(msg),
				OutputLen:    d.OutputLen,
				RequestID:    prefix + strconv.Itoa(c) + "-" + strconv.Itoa(k),
				Conversation: c,
				Turn:         k,
			})
		}
	}
	return reqs, nil
}
