package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/sim/kvstore"
)

// The side channel's server: a prefill engine answers decode engines'
// handshakes, reads, notifications and heartbeats from its KV store. The
// protocol (the NIXL stand-in) and its client side are in package kvstore.

// kvIdleTimeout closes side-channel connections nobody uses.
const kvIdleTimeout = time.Minute

// serveKV accepts side-channel connections until ctx ends.
func (e *Engine) serveKV(ctx context.Context, ln net.Listener) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
	)
	stop := context.AfterFunc(ctx, func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for c := range conns {
			c.Close()
		}
	})
	defer stop()
	defer wg.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("kv side channel: accept: %w", err)
		}
		mu.Lock()
		conns[conn] = struct{}{}
		mu.Unlock()
		wg.Go(func() {
			defer func() {
				mu.Lock()
				delete(conns, conn)
				mu.Unlock()
				conn.Close()
			}()
			e.serveKVConn(conn)
		})
	}
}

func (e *Engine) serveKVConn(conn net.Conn) {
	dec := json.NewDecoder(bufio.NewReader(conn))
	enc := json.NewEncoder(conn)
	for {
		if err := conn.SetReadDeadline(time.Now().Add(kvIdleTimeout)); err != nil {
			return
		}
		var req kvstore.Request
		if err := dec.Decode(&req); err != nil {
			return // peer closed, idle, or sent garbage: nothing to answer
		}
		if err := enc.Encode(e.handleKV(req)); err != nil {
			return
		}
	}
}

func (e *Engine) handleKV(req kvstore.Request) kvstore.Reply {
	if e.dead.Load() {
		return kvstore.Reply{Code: kvstore.CodeEngineDead, Error: kvstore.ErrEngineDead.Error()}
	}
	switch req.Op {
	case kvstore.OpHandshake:
		if req.Compat != e.compat {
			return kvstore.Reply{Code: kvstore.CodeIncompatible, Error: fmt.Sprintf("incompatible engines: compatibility hash %q != %q (model, block size and protocol must match)", req.Compat, e.compat)}
		}
		return kvstore.Reply{OK: true, EngineID: e.engineID, Compat: e.compat}
	case kvstore.OpRead:
		h, err := e.kv.Read(req.RequestID, req.BlockIDs)
		if err != nil {
			code := kvstore.CodeUnknownRequest
			if errors.Is(err, kvstore.ErrBlockMismatch) {
				code = kvstore.CodeBlockMismatch
			}
			e.log.Warn("KV read refused", logging.KeyRequestID, req.RequestID, "peer", req.EngineID, logging.Err(err))
			return kvstore.Reply{Code: code, Error: err.Error()}
		}
		e.stats.kvServed.Add(1)
		if req.PeerRequestID != "" && h.ExternalID != "" && req.PeerRequestID != h.ExternalID {
			e.stats.requestIDMismatches.Add(1)
			e.log.Warn("decode leg carried a different X-Request-Id than the prefill leg",
				logging.KeyRequestID, req.RequestID, "prefill_x_request_id", h.ExternalID, "decode_x_request_id", req.PeerRequestID)
		}
		return kvstore.Reply{OK: true, Digest: h.Digest, NumTokens: h.NumTokens}
	case kvstore.OpNotify:
		if !e.kv.Release(req.RequestID) {
			e.stats.unknownNotifs.Add(1)
			e.log.Warn("Potentially invalid KV blocks for unrecognized request; the blocks may have expired",
				logging.KeyRequestID, req.RequestID)
			return kvstore.Reply{Code: kvstore.CodeUnknownRequest, Error: kvstore.ErrUnknownRequest.Error()}
		}
		return kvstore.Reply{OK: true}
	case kvstore.OpHeartbeat:
		if !e.kv.Extend(req.RequestID) {
			return kvstore.Reply{Code: kvstore.CodeUnknownRequest, Error: kvstore.ErrUnknownRequest.Error()}
		}
		return kvstore.Reply{OK: true}
	}
	return kvstore.Reply{Code: kvstore.CodeBadRequest, Error: fmt.Sprintf("unknown op %q", req.Op)}
}
