package workers

import (
	"context"
	"io"
	"net/http"
	"strings"

	"github.com/pdq-dev/pdq/dispatcher/enginecall"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// Engine calls: see enginecall.Call. A decode worker answers them
// for its engine.

// engineCallLimit bounds the engine calls a worker runs at once.
const engineCallLimit = 16

// maxEngineAnswer keeps an answer within a NATS message.
const maxEngineAnswer = 7 << 20

// engineCallPaths are the calls a worker forwards: nothing else reaches
// its engine this way.
var engineCallPaths = map[string]string{
	"/tokenize":      http.MethodPost,
	"/detokenize":    http.MethodPost,
	"/version":       http.MethodGet,
	"/v1/embeddings": http.MethodPost,
}

// engineCall forwards one call to the engine and returns its answer as it
// came; a call that gets none is a 502 in vLLM's error envelope.
func (w *Worker) engineCall(ctx context.Context, call enginecall.Request) enginecall.Answer {
	path, _, _ := strings.Cut(call.Path, "?")
	if method, ok := engineCallPaths[path]; !ok || method != call.Method {
		return enginecall.ErrorAnswer(openai.NewError(http.StatusNotFound, "no engine call %s %s", call.Method, call.Path))
	}
	resp, err := w.engine.Do(ctx, call.Method, call.Path, call.Body)
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn("engine call failed", logging.Err(err), "path", path)
		}
		return enginecall.ErrorAnswer(openai.NewError(http.StatusBadGateway, "decode engine unreachable"))
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
		// pdq's key, not the client's: the same answer as on generation.
		return enginecall.ErrorAnswer(openai.NewError(http.StatusBadGateway, "decode engine refused pdq (%d): check PDQ_ENGINE_API_KEY", resp.StatusCode))
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxEngineAnswer+1))
	switch {
	case err != nil:
		return enginecall.ErrorAnswer(openai.NewError(http.StatusBadGateway, "decode engine: reading its answer: %v", err))
	case len(body) > maxEngineAnswer:
		return enginecall.ErrorAnswer(openai.NewError(http.StatusBadGateway, "decode engine answered more than %d bytes", maxEngineAnswer))
	}
	return enginecall.Answer{Status: resp.StatusCode, ContentType: resp.Header.Get("Content-Type"), Body: body}
}
