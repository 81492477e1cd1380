package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

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
	engine, err := sim.New(cfg, log)
	if err != nil {
		return err
	}
	return engine.Run(ctx)
}
