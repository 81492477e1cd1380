package openai

import (
	"testing"
)

func TestBatchMerge(t *testing.T) {
	t.Run("responses", func(t *testing.T) {
		m := NewBatchMerge("cmpl-b", 1)
		out, err := m.Whole([][]byte{
			[]byte(`{"id":"cmpl-b-0","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"<a>","finish_reason":"length"}],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":null},"kv_transfer_params":null}`),
			[]byte(`{"id":"cmpl-b-1","object":"text_completion","created":8,"model":"m","choices":[{"index":0,"text":"b","finish_reason":"stop"}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1,"prompt_tokens_details":null},"kv_transfer_params":null}`),
		})
		want := `{"id":"cmpl-b","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"<a>","finish_reason":"length"},{"index":1,"text":"b","finish_reason":"stop"}],"usage":{"prompt_tokens":7,"total_tokens":10,"completion_tokens":3,"prompt_tokens_details":null},"kv_transfer_params":null}`
		if err != nil || string(out) != want {
			t.Errorf("merged = %s, %v\nwant      %s", out, err, want)
		}
	})
	t.Run("chunks", func(t *testing.T) {
		m := NewBatchMerge("cmpl-b", 2)
		for _, tc := range []struct {
			i        int
			in, want string
			held     bool
		}{
			{0, `{"id":"cmpl-b-0","choices":[{"index":1,"text":"x"}]}`, `{"id":"cmpl-b","choices":[{"index":1,"text":"x"}]}`, false},
			{2, `{"id":"cmpl-b-2","choices":[{"index":0,"text":"y"},{"index":1,"text":"z"}]}`, `{"id":"cmpl-b","choices":[{"index":4,"text":"y"},{"index":5,"text":"z"}]}`, false},
			{1, `{"id":"cmpl-b-1","choices":[],"usage":{"prompt_tokens":1,"total_tokens":3,"completion_tokens":2}}`, "", true},
			{0, `{"id":"cmpl-b-0","choices":[],"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}`, "", true},
		} {
			out, held, err := m.Chunk(tc.i, []byte(tc.in))
			if err != nil || held != tc.held || string(out) != tc.want {
				t.Errorf("chunk(%d, %s) = %s, %v, %v; want %s, %v", tc.i, tc.in, out, held, err, tc.want, tc.held)
			}
		}
		want := `{"id":"cmpl-b","choices":[],"usage":{"prompt_tokens":3,"total_tokens":6,"completion_tokens":3}}`
		if got := string(m.Tail()); got != want {
			t.Errorf("usage chunk = %s, want %s", got, want)
		}
	})
	t.Run("odd choices", func(t *testing.T) {
		m := NewBatchMerge("cmpl-b", 2)
		for _, tc := range []struct {
			in, want string
			fails    bool
		}{
			{in: `{"id":"x","choices":null}`, want: `{"id":"cmpl-b","choices":null}`},
			{in: `{"id":"x","choices":[ ]}`, want: `{"id":"cmpl-b","choices":[ ]}`},
			{in: `{"id":"x","choices":[{"text":"a"}]}`, want: `{"id":"cmpl-b","choices":[{"text":"a","index":2}]}`},
			{in: `{"id":"x","choices":[5]}`, fails: true},
			{in: `{"id":"x","choices":[{"index":"0"}]}`, fails: true},
			{in: `{"id":"x","choices":{}}`, fails: true},
		} {
			out, held, err := m.Chunk(1, []byte(tc.in))
			if (err != nil) != tc.fails || held || string(out) != tc.want {
				t.Errorf("chunk(1, %s) = %s, %v, %v; want %s, fails %v", tc.in, out, held, err, tc.want, tc.fails)
			}
		}
	})
	t.Run("not JSON", func(t *testing.T) {
		m := NewBatchMerge("cmpl-b", 1)
		if _, _, err := m.Chunk(0, []byte(`{"id":`)); err == nil {
			t.Error("a broken chunk was merged")
		}
	})
}
