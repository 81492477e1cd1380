package kvstore

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"testing"
	"time"
)

// TestCallRefusals: a refusal's code comes back as the matching sentinel,
// so a decode engine can tell an unknown request from other failures. The
// engine's tests (package sim) run the protocol against a real server.
func TestCallRefusals(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// The server refuses each request with the code named by its id.
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		dec, enc := json.NewDecoder(bufio.NewReader(conn)), json.NewEncoder(conn)
		for {
			var req Request
			if dec.Decode(&req) != nil {
				return
			}
			if enc.Encode(Reply{Code: req.RequestID, Error: "refused: " + req.RequestID}) != nil {
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for code, want := range map[string]error{CodeUnknownRequest: ErrUnknownRequest, CodeBlockMismatch: ErrBlockMismatch,
		CodeEngineDead: ErrEngineDead} {
		if _, err := c.Call(ctx, Request{Op: OpRead, RequestID: code}); !errors.Is(err, want) {
			t.Errorf("refused with %s: %v, want %v", code, err, want)
		}
	}
	_, err = c.Call(ctx, Request{Op: OpRead, RequestID: CodeIncompatible})
	if err == nil || errors.Is(err, ErrUnknownRequest) || errors.Is(err, ErrBlockMismatch) || errors.Is(err, ErrEngineDead) {
		t.Errorf("refused as incompatible: %v, want the reply's error and no sentinel", err)
	}
}
