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

// The side channel stands in for NIXL: a decode engine connects to the
// prefill engine's remote_host:remote_port, checks that the two builds are
// compatible (handshake), reads the blocks of one request (read), and tells
// the prefill engine it may free them (notify). A decode request that waits
// for a slot renews the prefill's lease (heartbeat). Messages are JSON lines,
// one reply per request.

// kvOp names a side-channel operation.
type kvOp string

const (
	opHandshake kvOp = "handshake"
	opRead      kvOp = "read"
	opNotify    kvOp = "notify"
	opHeartbeat kvOp = "heartbeat"
)

type kvRequest struct {
	Op        kvOp   `json:"op"`
	EngineID  string `json:"engine_id,omitempty"`
	Compat    string `json:"compat,omitempty"`
	RequestID string `json:"request_id,omitempty"`
	BlockIDs  []int  `json:"block_ids,omitempty"`
	TPSize    int    `json:"tp_size,omitempty"`
	// PeerRequestID is the X-Request-Id the decode leg came with, so the
	// prefill engine can count legs that did not share one.
	PeerRequestID string `json:"peer_request_id,omitempty"`
}

// Codes of failed replies.
const (
	codeUnknownRequest = "unknown_request"
	codeBlockMismatch  = "block_mismatch"
	codeEngineDead     = "engine_dead"
	codeIncompatible   = "incompatible"
	codeBadRequest     = "bad_request"
)

type kvReply struct {
	OK        bool   `json:"ok"`
	Code      string `json:"code,omitempty"`
	Error     string `json:"error,omitempty"`
	EngineID  string `json:"engine_id,omitempty"`
	Compat    string `json:"compat,omitempty"`
	Digest    string `json:"digest,omitempty"`
	NumTokens int    `json:"num_tokens,omitempty"`
}

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
		var req kvRequest
		if err := dec.Decode(&req); err != nil {
			return // peer closed, idle, or sent garbage: nothing to answer
		}
		if err := enc.Encode(e.handleKV(req)); err != nil {
			return
		}
	}
}

func (e *Engine) handleKV(req kvRequest) kvReply {
	if e.dead.Load() {
		return kvReply{Code: codeEngineDead, Error: kvstore.ErrEngineDead.Error()}
	}
	switch req.Op {
	case opHandshake:
		if req.Compat != e.compat {
			return kvReply{Code: codeIncompatible, Error: fmt.Sprintf("incompatible engines: compatibility hash %q != %q (model, block size and protocol must match)", req.Compat, e.compat)}
		}
		return kvReply{OK: true, EngineID: e.engineID, Compat: e.compat}
	case opRead:
		h, err := e.kv.Read(req.RequestID, req.BlockIDs)
		if err != nil {
			code := codeUnknownRequest
			if errors.Is(err, kvstore.ErrBlockMismatch) {
				code = codeBlockMismatch
			}
			e.log.Warn("KV read refused", logging.KeyRequestID, req.RequestID, "peer", req.EngineID, logging.Err(err))
			return kvReply{Code: code, Error: err.Error()}
		}
		e.stats.kvServed.Add(1)
		if req.PeerRequestID != "" && h.ExternalID != "" && req.PeerRequestID != h.ExternalID {
			e.stats.requestIDMismatches.Add(1)
			e.log.Warn("decode leg carried a different X-Request-Id than the prefill leg",
				logging.KeyRequestID, req.RequestID, "prefill_x_request_id", h.ExternalID, "decode_x_request_id", req.PeerRequestID)
		}
		return kvReply{OK: true, Digest: h.Digest, NumTokens: h.NumTokens}
	case opNotify:
		if !e.kv.Release(req.RequestID) {
			e.stats.unknownNotifs.Add(1)
			e.log.Warn("Potentially invalid KV blocks for unrecognized request; the blocks may have expired",
				logging.KeyRequestID, req.RequestID)
			return kvReply{Code: codeUnknownRequest, Error: kvstore.ErrUnknownRequest.Error()}
		}
		return kvReply{OK: true}
	case opHeartbeat:
		if !e.kv.Extend(req.RequestID) {
			return kvReply{Code: codeUnknownRequest, Error: kvstore.ErrUnknownRequest.Error()}
		}
		return kvReply{OK: true}
	}
	return kvReply{Code: codeBadRequest, Error: fmt.Sprintf("unknown op %q", req.Op)}
}

// kvConn is a decode engine's connection to a prefill engine's side channel.
type kvConn struct {
	conn net.Conn
	dec  *json.Decoder
	enc  *json.Encoder
}

// dialKV connects to a side channel, bounded by ctx.
func dialKV(ctx context.Context, addr string) (*kvConn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("connect to kv side channel %s: %w", addr, err)
	}
	return &kvConn{conn: conn, dec: json.NewDecoder(bufio.NewReader(conn)), enc: json.NewEncoder(conn)}, nil
}

// call sends one request and reads its reply. A refusal comes back as an
// error that wraps the matching sentinel.
func (c *kvConn) call(ctx context.Context, req kvRequest) (kvReply, error) {
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(time.Now()) })
	defer stop()
	if err := c.enc.Encode(req); err != nil {
		return kvReply{}, fmt.Errorf("kv %s: send: %w", req.Op, ctxErr(ctx, err))
	}
	var rep kvReply
	if err := c.dec.Decode(&rep); err != nil {
		return kvReply{}, fmt.Errorf("kv %s: receive: %w", req.Op, ctxErr(ctx, err))
	}
	if !rep.OK {
		var base error
		switch rep.Code {
		case codeUnknownRequest:
			base = kvstore.ErrUnknownRequest
		case codeBlockMismatch:
			base = kvstore.ErrBlockMismatch
		case codeEngineDead:
			base = kvstore.ErrEngineDead
		default:
			base = errors.New(rep.Error)
		}
		return rep, fmt.Errorf("kv %s %s: %w", req.Op, req.RequestID, base)
	}
	return rep, nil
}

func (c *kvConn) close() { c.conn.Close() }

// ctxErr prefers the context's error, so an abort reads as one and not as
// the i/o timeout it caused.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// kvOneShot dials, sends one request and hangs up: for notifications and
// heartbeats, which need no handshake.
func kvOneShot(ctx context.Context, addr string, req kvRequest) error {
	c, err := dialKV(ctx, addr)
	if err != nil {
		return err
	}
	defer c.close()
	_, err = c.call(ctx, req)
	return err
}
