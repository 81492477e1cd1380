package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"strconv"

	"github.com/pdq-dev/pdq/pkg/sim"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
)

func runSim(ctx context.Context, args []string, _, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: pdq sim [flags]\n\nA vLLM-compatible simulated engine that enforces the NIXL P/D handshake.\n\nFlags:")
		fs.PrintDefaults()
	}
	cfg := simconfig.DefaultConfig()
	cfg.RegisterFlags(fs)
	engines := fs.Int("engines", 1, "engines to serve from this process, on consecutive HTTP and side-channel ports (port 0: free ones); --engine-id gets -<i> appended")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "pdq sim: unexpected arguments %q\n", fs.Args())
		return errUsage
	}
	log, err := newLogger(stderr)
	if err != nil {
		return err
	}
	cfgs, err := engineConfigs(cfg, *engines)
	if err != nil {
		fmt.Fprintf(stderr, "pdq sim: %v\n", err)
		return errUsage
	}
	// Every engine is built before any listens, so that a bad setting
	// fails them all at once.
	var all []*sim.Engine
	for _, c := range cfgs {
		e, err := sim.New(c, log)
		if err != nil {
			return err
		}
		all = append(all, e)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(all))
	for _, e := range all {
		go func() {
			err := e.Run(ctx)
			cancel() // one engine down takes the process down
			errs <- err
		}()
	}
	var first error
	for range all {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// engineConfigs are the configurations of n engines served by one
// process: cfg's ports counted up from, unless 0, and its engine id, if
// set, suffixed with each engine's index.
func engineConfigs(cfg simconfig.Config, n int) ([]simconfig.Config, error) {
	if n < 1 {
		return nil, fmt.Errorf("--engines must be at least 1, got %d", n)
	}
	if n == 1 {
		return []simconfig.Config{cfg}, nil
	}
	host, port, err := net.SplitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("--addr %q: %w", cfg.Addr, err)
	}
	base, err := strconv.Atoi(port)
	if err != nil {
		return nil, fmt.Errorf("--addr %q: the port is not a number", cfg.Addr)
	}
	out := make([]simconfig.Config, n)
	for i := range out {
		c := cfg
		if base != 0 {
			c.Addr = net.JoinHostPort(host, strconv.Itoa(base+i))
		}
		if c.KVPort != 0 {
			c.KVPort += i
		}
		if c.EngineID != "" {
			c.EngineID += "-" + strconv.Itoa(i)
		}
		out[i] = c
	}
	return out, nil
}
