// Package nixl is the prefill/decode handshake of vLLM's NIXL KV connector,
// as a router drives it: the only code that builds a prefill body and a
// decode body from a client's body, and that checks what a prefill
// returns. pdq's workers and pdq bench's --pd-prefill both use it.
//
// For one request, whose client body is B:
//
//  1. The prefill leg: B with kv_transfer_params set to the skeleton
//     {"do_remote_decode":true, "do_remote_prefill":false, and the remote
//     fields null}, stream false, max_tokens 1 (and max_completion_tokens
//     1 if B has it), without stream_options, min_tokens or
//     min_completion_tokens ([PrefillBody]). The router sends it with an
//     X-Request-Id.
//  2. The prefill engine computes the prompt's KV, holds its blocks, and
//     answers 200 with kv_transfer_params: do_remote_prefill true, its
//     engine id, the block ids, its side-channel host and port, and (vLLM
//     0.14 and later) the remote request id. [ExtractKVParams] takes them
//     out of the answer as opaque bytes, and refuses an answer without
//     them, or with params that name no engine or no blocks: a decode
//     engine would silently recompute the prompt from such an answer.
//  3. A loopback or unspecified remote_host is replaced by a host the
//     decode engine can reach ([FixRemoteHost]); nothing else is changed.
//  4. The decode leg: B, unchanged but for those kv_transfer_params
//     ([DecodeBody]), with the SAME X-Request-Id as the prefill leg. The
//     decode engine reads the blocks over NIXL once, and the prefill
//     engine frees them.
//  5. A decode that will not run (its client gone, say) still reads the
//     blocks, so that the prefill engine frees them before its lease:
//     [ReleaseBody], one streamed output token.
//
// The bodies are the client's bytes with these fields spliced in (see
// [jsonobj.Edit]): its other members keep their order and spelling, and a
// large prompt is copied once, not decoded and encoded; the Parts forms
// leave it in place for a write of several pieces.
package nixl

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
)

// Keys of the request body that the handshake sets or removes.
const (
	keyKVTransferParams    = "kv_transfer_params"
	keyStream              = "stream"
	keyStreamOptions       = "stream_options"
	keyMaxTokens           = "max_tokens"
	keyMaxCompletionTokens = "max_completion_tokens"
	keyMinTokens           = "min_tokens"
	keyMinCompletionTokens = "min_completion_tokens"
	keyRemoteHost          = "remote_host"
	keyRemoteEngineID      = "remote_engine_id"
	keyRemoteBlockIDs      = "remote_block_ids"
	keyDoRemotePrefill     = "do_remote_prefill"
)

// PrefillParams is what the prefill leg asks for, exactly as vLLM's
// reference proxy sends it.
const PrefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// prefillParams is PrefillParams as the bytes an edit takes, made once.
var prefillParams = json.RawMessage(PrefillParams)

// Values the handshake sets.
var (
	jsonFalse = []byte("false")
	jsonTrue  = []byte("true")
	jsonOne   = []byte("1")
	jsonNull  = []byte("null")
)

// ErrNoKVParams means a prefill engine answered 200 without
// kv_transfer_params: the decode engine would silently recompute the
// prompt, so this is an error, never a fall-back.
var ErrNoKVParams = errors.New("prefill engine answered 200 without kv_transfer_params")

// ErrIncompleteKVParams means a prefill engine's kv_transfer_params cannot
// point a decode engine at the prompt's blocks.
var ErrIncompleteKVParams = errors.New("prefill engine answered 200 with incomplete kv_transfer_params")

// PrefillBody builds the prefill leg's body from the client's: the
// kv_transfer_params skeleton, stream false, one output token, and none of
// the fields a prefill does not support (stream_options, min_tokens). The
// rest of the body is passed on as it came.
func PrefillBody(client json.RawMessage) ([]byte, error) {
	ops := oneToken(prefillParams)
	return edit(client, ops[:]...)
}

// PrefillParts is PrefillBody as the pieces it is made of, to send
// without joining them (see jsonobj.EditParts).
func PrefillParts(client json.RawMessage) ([][]byte, error) {
	ops := oneToken(prefillParams)
	return editParts(client, ops[:]...)
}

// DecodeBody builds the decode leg's body: the client's body, with the
// prefill's kv_transfer_params when there are any. Without params (a
// decode-only job) the client's bytes go out untouched.
func DecodeBody(client, params json.RawMessage) ([]byte, error) {
	if len(params) == 0 {
		return client, nil
	}
	return edit(client, jsonobj.Set(keyKVTransferParams, params))
}

// DecodeParts is DecodeBody as the pieces it is made of; with whole (a
// replay, which has no client to stream to) it also asks, with
// oneResponse, for the whole answer in one response.
func DecodeParts(client, params json.RawMessage, whole bool) ([][]byte, error) {
	var ops [3]jsonobj.Op
	n := 0
	if len(params) > 0 {
		ops[n] = jsonobj.Set(keyKVTransferParams, params)
		n++
	}
	if whole {
		n += copy(ops[n:], oneResponse[:])
	}
	if n == 0 {
		return [][]byte{client}, nil
	}
	return editParts(client, ops[:n]...)
}

// ReleaseBody builds a decode call whose only purpose is to read, and so
// free, a prefill's KV blocks: the decode body, cut to one output token.
// It is streamed, without usage: an engine answers a stream's errors in the
// stream once it has begun, so an error status means it never ran the
// call, and the blocks are still held and unread.
func ReleaseBody(client, params json.RawMessage) ([]byte, error) {
	if len(params) == 0 {
		params = jsonNull
	}
	ops := oneToken(params)
	ops[1] = jsonobj.Set(keyStream, jsonTrue)
	return edit(client, ops[:]...)
}

// oneToken are the edits that make a body a non-streamed request for one
// output token with params, as vLLM's reference proxy makes its prefill
// request: max_completion_tokens only if the client sent it, and no
// stream_options, min_tokens or min_completion_tokens.
func oneToken(params json.RawMessage) [7]jsonobj.Op {
	return [...]jsonobj.Op{
		jsonobj.Set(keyKVTransferParams, params),
		jsonobj.Set(keyStream, jsonFalse),
		jsonobj.Set(keyMaxTokens, jsonOne),
		jsonobj.Replace(keyMaxCompletionTokens, jsonOne),
		jsonobj.Delete(keyStreamOptions),
		jsonobj.Delete(keyMinTokens),
		jsonobj.Delete(keyMinCompletionTokens),
	}
}

// oneResponse are the edits that make a body ask for the whole answer in
// one response: what a replay's decode sends.
var oneResponse = [...]jsonobj.Op{jsonobj.Set(keyStream, jsonFalse), jsonobj.Delete(keyStreamOptions)}

// editParts is [jsonobj.EditParts] with the error a bad request body gets,
// for a long body: its pieces go to the engine as they are (vllm.Post),
// the prompt not copied. A short body is edited into one piece instead:
// copying it costs less than a write per piece, and the HTTP transport
// sends the headers and a one-piece body in one write.
func editParts(body []byte, ops ...jsonobj.Op) ([][]byte, error) {
	if len(body) < onePieceBelow {
		out, err := edit(body, ops...)
		if err != nil {
			return nil, err
		}
		return [][]byte{out}, nil
	}
	parts, err := jsonobj.EditParts(body, ops...)
	if err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	return parts, nil
}

// onePieceBelow is the body size under which editParts makes one piece.
const onePieceBelow = 64 << 10

// edit is [jsonobj.Edit] with the error a bad request body gets.
func edit(body []byte, ops ...jsonobj.Op) ([]byte, error) {
	out, err := jsonobj.Edit(body, ops...)
	if err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	return out, nil
}

// ExtractKVParams returns the top-level kv_transfer_params of a prefill
// response, as a slice of it. It fails with ErrNoKVParams when they are
// missing, null, or not an object, and with ErrIncompleteKVParams when
// they cannot point a decode engine at the blocks: remote_engine_id or
// remote_block_ids missing or empty, or do_remote_prefill not true. vLLM's
// decode engine would recompute the prompt, or worse, from such params.
// The values themselves stay opaque: their types differ between vLLM
// versions.
func ExtractKVParams(response []byte) (json.RawMessage, error) {
	kv, _, err := jsonobj.Get(response, keyKVTransferParams)
	if err != nil {
		return nil, fmt.Errorf("prefill response is not a JSON object: %w", err)
	}
	if len(kv) == 0 || kv[0] != '{' {
		return nil, ErrNoKVParams
	}
	vals, err := jsonobj.Lookup(kv, keyRemoteEngineID, keyRemoteBlockIDs, keyDoRemotePrefill)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrIncompleteKVParams, err)
	}
	for i, key := range []string{keyRemoteEngineID, keyRemoteBlockIDs} {
		if jsonobj.Empty(vals[i]) {
			return nil, fmt.Errorf("%w: no %s", ErrIncompleteKVParams, key)
		}
	}
	if doRemotePrefill := vals[2]; string(doRemotePrefill) != "true" {
		return nil, fmt.Errorf("%w: do_remote_prefill is %s, not true", ErrIncompleteKVParams, orMissing(doRemotePrefill))
	}
	return kv, nil
}

func orMissing(raw json.RawMessage) string {
	if len(raw) == 0 {
		return "missing"
	}
	if s := string(raw); len(s) > 40 {
		return s[:40] + "..."
	}
	return string(raw)
}

// FixRemoteHost replaces remote_host when the engine advertised a host no
// decode engine elsewhere can reach (loopback, unspecified or empty) and
// host is a routable one. Everything else in params keeps its bytes; a
// params object it cannot read is returned unchanged.
func FixRemoteHost(params json.RawMessage, host string) (json.RawMessage, bool) {
	if IsLocalHost(host) {
		return params, false // nothing better to offer
	}
	raw, _, err := jsonobj.Get(params, keyRemoteHost)
	if err != nil {
		return params, false
	}
	var current string
	if len(raw) > 0 && string(raw) != "null" {
		if err := json.Unmarshal(raw, &current); err != nil {
			return params, false // not a string: not ours to judge
		}
	}
	if !IsLocalHost(current) {
		return params, false
	}
	out, err := jsonobj.Edit(params, jsonobj.Set(keyRemoteHost, jsonobj.AppendString(nil, host)))
	if err != nil {
		return params, false
	}
	return out, true
}

// IsLocalHost reports whether host means "this machine" or nothing at all:
// empty, localhost, a loopback or an unspecified address.
func IsLocalHost(host string) bool {
	h := strings.Trim(strings.TrimSpace(host), "[]")
	if h == "" || strings.EqualFold(h, "localhost") || strings.EqualFold(h, "ip6-localhost") {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && (ip.IsLoopback() || ip.IsUnspecified())
}
