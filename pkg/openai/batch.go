package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
)

// A completions request may carry a batch of prompts, which pdq runs as
// one job per prompt (vLLM's NIXL handoff carries one prompt's KV). The
// answers are merged into the shape vLLM gives a batch: one response id,
// choice i*n+j for choice j of prompt i, and the usage summed.

// BatchMerge rewrites the answers of a batch's jobs into one.
type BatchMerge struct {
	id []byte // the batch's response id, as JSON
	n  int    // choices per prompt
	// usage is the last usage-only chunk of the streams, held back to be
	// summed into one.
	usage []byte
	sum   Usage
}

// NewBatchMerge merges the answers of a batch of n choices per prompt
// under the response id id.
func NewBatchMerge(id string, n int) *BatchMerge {
	return &BatchMerge{id: jsonobj.AppendString(nil, id), n: n}
}

// addUsage adds the counts of a usage object to the batch's sum.
func (m *BatchMerge) addUsage(raw json.RawMessage) error {
	var v Usage
	if err := json.Unmarshal(raw, &v); err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	m.sum.PromptTokens += v.PromptTokens
	m.sum.TotalTokens += v.TotalTokens
	m.sum.CompletionTokens += v.CompletionTokens
	return nil
}

// Chunk rewrites a stream chunk of prompt i: the batch's id, and the
// choices' indexes. A usage-only chunk (the end of a stream asked with
// include_usage) is held back (held), to be summed into one.
func (m *BatchMerge) Chunk(i int, data []byte) (out []byte, held bool, err error) {
	v, err := jsonobj.Lookup(data, "choices", "usage")
	if err != nil {
		return nil, false, fmt.Errorf("a chunk of prompt %d is not JSON: %w", i, err)
	}
	choices, usage := v[0], v[1]
	if none(choices) && !isNull(usage) {
		if err := m.addUsage(usage); err != nil {
			return nil, false, err
		}
		m.usage = data
		return nil, true, nil
	}
	return m.rewrite(i, data, choices)
}

// rewrite sets a response's or chunk's id to the batch's, and its choices'
// indexes to their place in the batch.
func (m *BatchMerge) rewrite(i int, data, choices []byte) ([]byte, bool, error) {
	ops := []jsonobj.Op{jsonobj.Set("id", m.id)}
	if !none(choices) {
		list, err := m.reindex(nil, i, choices)
		if err != nil {
			return nil, false, err
		}
		ops = append(ops, jsonobj.Set("choices", append(append([]byte{'['}, list...), ']')))
	}
	out, err := jsonobj.Edit(data, ops...)
	return out, false, err
}

// reindex renumbers prompt i's choices, a JSON array, choice j becoming
// i*n+j, and appends them to list, a JSON array's members.
func (m *BatchMerge) reindex(list []byte, i int, choices []byte) ([]byte, error) {
	err := jsonobj.LookupEach(choices, []string{"index"}, func(_ int, ch []byte, v []json.RawMessage, _ []int) error {
		var index int
		if v[0] != nil {
			if err := json.Unmarshal(v[0], &index); err != nil {
				return err
			}
		}
		ch, err := jsonobj.Edit(ch, jsonobj.Set("index", strconv.AppendInt(nil, int64(i*m.n+index), 10)))
		if err != nil {
			return err
		}
		if len(list) > 0 {
			list = append(list, ',')
		}
		list = append(list, ch...)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("the choices of prompt %d: %w", i, err)
	}
	return list, nil
}

// none reports whether a choices member is absent, null or empty.
func none(choices []byte) bool {
	return isNull(choices) || choices[0] == '[' && len(bytes.TrimSpace(choices[1:len(choices)-1])) == 0
}

// isNull reports whether a member is absent or null.
func isNull(v []byte) bool { return v == nil || string(v) == "null" }

// Tail is the one usage chunk of a merged stream, or nil when the
// streams sent none.
func (m *BatchMerge) Tail() []byte {
	if m.usage == nil {
		return nil
	}
	out, err := jsonobj.Edit(m.usage, jsonobj.Set("id", m.id))
	if err == nil {
		out, err = m.withUsage(out)
	}
	if err != nil {
		return m.usage
	}
	return out
}

// withUsage puts the summed usage into obj's usage object, keeping the
// object's other fields (prompt_tokens_details, ...).
func (m *BatchMerge) withUsage(obj []byte) ([]byte, error) {
	usage, _, err := jsonobj.Get(obj, "usage")
	if err != nil {
		return nil, err
	}
	if isNull(usage) {
		return obj, nil
	}
	num := func(n int) []byte { return strconv.AppendInt(nil, int64(n), 10) }
	u, err := jsonobj.Edit(usage, jsonobj.Set("prompt_tokens", num(m.sum.PromptTokens)),
		jsonobj.Set("total_tokens", num(m.sum.TotalTokens)), jsonobj.Set("completion_tokens", num(m.sum.CompletionTokens)))
	if err != nil {
		return nil, err
	}
	return jsonobj.Edit(obj, jsonobj.Set("usage", u))
}

// Whole merges the non-streamed responses of a batch: the first
// prompt's response, with the batch's id, every prompt's choices, and the
// usage summed.
func (m *BatchMerge) Whole(parts [][]byte) ([]byte, error) {
	var list []byte
	for i, data := range parts {
		v, err := jsonobj.Lookup(data, "choices", "usage")
		if err != nil {
			return nil, fmt.Errorf("the response of prompt %d: %w", i, err)
		}
		if !isNull(v[1]) {
			if err := m.addUsage(v[1]); err != nil {
				return nil, err
			}
		}
		if !none(v[0]) {
			if list, err = m.reindex(list, i, v[0]); err != nil {
				return nil, err
			}
		}
	}
	out, err := jsonobj.Edit(parts[0], jsonobj.Set("id", m.id), jsonobj.Set("choices", append(append([]byte{'['}, list...), ']')))
	if err == nil {
		out, err = m.withUsage(out)
	}
	return out, err
}
