package kvstore

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"
)

// The side channel stands in for NIXL: a decode engine connects to the
// prefill engine's remote_host:remote_port, checks that the two builds are
// compatible (handshake), reads the blocks of one request (read), and tells
// the prefill engine it may free them (notify). A decode request that waits
// for a slot renews the prefill's lease (heartbeat). Messages are JSON lines,
// one reply per request. This file is the protocol and its client side,
// a decode engine's; the server side is the prefill engine's (package sim),
// which answers from its Store. The protocol lives here, beside the Store
// it reads and frees, so that both sides share one definition.

// Op names a side-channel operation.
type Op string

// The operations; a Request names one.
const (
	OpHandshake Op = "handshake"
	OpRead      Op = "read"
	OpNotify    Op = "notify"
	OpHeartbeat Op = "heartbeat"
)

// Request is one message of a decode engine to a prefill engine's side
// channel; the fields an Op does not use are empty.
type Request struct {
	Op        Op     `json:"op"`
	EngineID  string `json:"engine_id,omitempty"`
	Compat    string `json:"compat,omitempty"`
	RequestID string `json:"request_id,omitempty"`
	BlockIDs  []int  `json:"block_ids,omitempty"`
	TPSize    int    `json:"tp_size,omitempty"`
	// PeerRequestID is the X-Request-Id the decode leg came with, so the
	// prefill engine can count legs that did not share one.
	PeerRequestID string `json:"peer_request_id,omitempty"`
}

// Codes of failed replies. Call turns the first three back into
// ErrUnknownRequest, ErrBlockMismatch and ErrEngineDead.
const (
	CodeUnknownRequest = "unknown_request"
	CodeBlockMismatch  = "block_mismatch"
	CodeEngineDead     = "engine_dead"
	CodeIncompatible   = "incompatible"
	CodeBadRequest     = "bad_request"
)

// Reply is the prefill engine's answer to one Request: OK, or a Code and
// an Error; a handshake says the engine's id and compatibility hash, a
// read what the blocks hold.
type Reply struct {
	OK        bool   `json:"ok"`
	Code      string `json:"code,omitempty"`
	Error     string `json:"error,omitempty"`
	EngineID  string `json:"engine_id,omitempty"`
	Compat    string `json:"compat,omitempty"`
	Digest    string `json:"digest,omitempty"`
	NumTokens int    `json:"num_tokens,omitempty"`
}

// Conn is a decode engine's connection to a prefill engine's side channel.
type Conn struct {
	conn net.Conn
	dec  *json.Decoder
	enc  *json.Encoder
}

// Dial connects to a side channel, bounded by ctx.
func Dial(ctx context.Context, addr string) (*Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("connect to kv side channel %s: %w", addr, err)
	}
	return &Conn{conn: conn, dec: json.NewDecoder(bufio.NewReader(conn)), enc: json.NewEncoder(conn)}, nil
}

// Call sends one request and reads its reply. A refusal comes back as an
// error that wraps the matching sentinel.
func (c *Conn) Call(ctx context.Context, req Request) (Reply, error) {
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(time.Now()) })
	defer stop()
	if err := c.enc.Encode(req); err != nil {
		return Reply{}, fmt.Errorf("kv %s: send: %w", req.Op, ctxErr(ctx, err))
	}
	var rep Reply
	if err := c.dec.Decode(&rep); err != nil {
		return Reply{}, fmt.Errorf("kv %s: receive: %w", req.Op, ctxErr(ctx, err))
	}
	if !rep.OK {
		var base error
		switch rep.Code {
		case CodeUnknownRequest:
			base = ErrUnknownRequest
		case CodeBlockMismatch:
			base = ErrBlockMismatch
		case CodeEngineDead:
			base = ErrEngineDead
		default:
			base = errors.New(rep.Error)
		}
		return rep, fmt.Errorf("kv %s %s: %w", req.Op, req.RequestID, base)
	}
	return rep, nil
}

// Close hangs up.
func (c *Conn) Close() { c.conn.Close() }

// ctxErr prefers the context's error, so an abort reads as one and not as
// the i/o timeout it caused.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// OneShot dials, sends one request and hangs up: for notifications and
// heartbeats, which need no handshake.
func OneShot(ctx context.Context, addr string, req Request) error {
	c, err := Dial(ctx, addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.Call(ctx, req)
	return err
}
