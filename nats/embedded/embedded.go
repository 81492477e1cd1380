// Package embedded runs a NATS server with JetStream inside the pdq
// process, for `pdq up` and for tests. Other processes can join it when it
// also listens on TCP.
package embedded

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// MaxPayload is the largest message the server accepts: long prompts travel
// inside job messages, and 8 MiB is the most the server takes without
// warnings (see jetstream.md, "Big payloads").
const MaxPayload = 8 << 20

// Defaults for the JetStream limits, so the store cannot grow to the
// server's own default of 75% of memory and disk.
const (
	DefaultMaxMemory = 256 << 20
	DefaultMaxStore  = 10 << 30
)

// readyTimeout bounds start-up.
const readyTimeout = 10 * time.Second

// Options configures the server.
type Options struct {
	// DataDir holds the JetStream store. Required: an empty StoreDir would
	// silently put it under $TMPDIR.
	DataDir string
	// Listen is host:port for TCP clients (port 0 picks a free one); empty
	// means in-process clients only.
	Listen string
	// MaxMemory and MaxStore bound JetStream; 0 takes the defaults above.
	MaxMemory int64
	MaxStore  int64
	// User and Password, or Token, when set, are required of every
	// client, the in-process ones too (give them to Connect).
	User, Password, Token string
}

// Server is a running embedded NATS server.
type Server struct {
	srv *server.Server
}

// Start starts a server and waits until it accepts connections.
func Start(opts Options, log *slog.Logger) (*Server, error) {
	if opts.DataDir == "" {
		return nil, errors.New("embedded nats: a data directory is required")
	}
	sopts := &server.Options{
		ServerName:         "pdq",
		JetStream:          true,
		StoreDir:           opts.DataDir,
		JetStreamMaxMemory: orDefault(opts.MaxMemory, DefaultMaxMemory),
		JetStreamMaxStore:  orDefault(opts.MaxStore, DefaultMaxStore),
		MaxPayload:         MaxPayload,
		NoSigs:             true,
		DontListen:         opts.Listen == "",
		Username:           opts.User,
		Password:           opts.Password,
		Authorization:      opts.Token,
	}
	if opts.Listen != "" {
		host, port, err := net.SplitHostPort(opts.Listen)
		if err != nil {
			return nil, fmt.Errorf("embedded nats: listen address %q: %w", opts.Listen, err)
		}
		p, err := strconv.Atoi(port)
		if err != nil || p < 0 || p > 65535 {
			return nil, fmt.Errorf("embedded nats: listen port %q is not a port number", port)
		}
		if p == 0 {
			p = server.RANDOM_PORT
		}
		sopts.Host, sopts.Port = host, p
	}
	srv, err := server.NewServer(sopts)
	if err != nil {
		return nil, fmt.Errorf("embedded nats: %w", err)
	}
	srv.SetLoggerV2(&slogAdapter{log: log.With("component", "nats")}, false, false, false)
	go srv.Start()
	if !srv.ReadyForConnections(readyTimeout) {
		srv.Shutdown()
		return nil, fmt.Errorf("embedded nats: not ready within %v (is %s free?)", readyTimeout, opts.Listen)
	}
	return &Server{srv: srv}, nil
}

// Connect opens an in-process client connection.
func (s *Server) Connect(opts ...nats.Option) (*nats.Conn, error) {
	nc, err := nats.Connect("", append(opts, nats.InProcessServer(s.srv))...)
	if err != nil {
		return nil, fmt.Errorf("embedded nats: connect: %w", err)
	}
	return nc, nil
}

// ClientURL is the nats:// URL other processes use, or "" when the server
// does not listen on TCP.
func (s *Server) ClientURL() string {
	if s.srv.Addr() == nil {
		return ""
	}
	return s.srv.ClientURL()
}

// Shutdown stops the server and waits until its store is written, so the
// next start does not have to rebuild its indexes.
func (s *Server) Shutdown() {
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
}

func orDefault(v, d int64) int64 {
	if v > 0 {
		return v
	}
	return d
}

// slogAdapter routes the server's log through slog. Its notices are
// start-up chatter, so they go to debug.
type slogAdapter struct{ log *slog.Logger }

func (a *slogAdapter) Noticef(format string, v ...any) { a.log.Debug(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Warnf(format string, v ...any)   { a.log.Warn(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Fatalf(format string, v ...any)  { a.log.Error(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Errorf(format string, v ...any)  { a.log.Error(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Debugf(format string, v ...any)  { a.log.Debug(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Tracef(format string, v ...any)  { a.log.Debug(fmt.Sprintf(format, v...)) }
