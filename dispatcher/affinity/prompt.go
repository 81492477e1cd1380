package affinity

import (
	"github.com/pdq-dev/pdq/pkg/openai"
)

// PromptHashes are the chunk hashes of a request's prompt: a chat's
// messages, each its role and its parts in order (a part other than text
// as the client sent it, so an image is part of the prefix), or a
// completions request's first prompt (a batch's first: the others share
// their job). Text past MaxChunks chunks is not read.
func PromptHashes(endpoint openai.Endpoint, req *openai.Request) []uint64 {
	var c Chunker
	switch endpoint {
	case openai.Chat:
		for _, m := range req.Messages {
			if !c.WriteString(m.Role) || !c.Write([]byte{0}) {
				break
			}
			parts, err := m.Parts()
			if err != nil {
				break
			}
			for _, p := range parts {
				if p.Type == "text" {
					c.WriteString(p.Text)
				} else {
					c.Write(p.Raw)
				}
			}
			if !c.Write([]byte{0}) {
				break
			}
		}
	default:
		if ps := req.Prompts(); len(ps) > 0 {
			if ps[0].Tokens != nil {
				var buf [4]byte
				for _, t := range ps[0].Tokens {
					buf[0], buf[1], buf[2], buf[3] = byte(t), byte(t>>8), byte(t>>16), byte(t>>24)
					if !c.Write(buf[:]) {
						break
					}
				}
			} else {
				c.WriteString(ps[0].Text)
			}
		}
	}
	return c.Hashes()
}
