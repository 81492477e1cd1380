package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/pdq-dev/pdq/pkg/bench"
)

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdq bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, "Usage: pdq bench [flags]\n\n"+
			"Benchmarks an OpenAI-compatible server as `vllm bench serve --dataset-name random` does, with its\n"+
			"flags, and prints its result block. $OPENAI_API_KEY, if set, is sent as a bearer token.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	cfg := bench.DefaultConfig()
	cfg.RegisterFlags(fs)
	if err := fs.Parse(bench.JoinNargs(args)); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "pdq bench: unexpected arguments %q\n", fs.Args())
		return errUsage
	}
	cfg.APIKey = os.Getenv("OPENAI_API_KEY")
	var progress io.Writer
	if !cfg.DisableTQDM && bench.IsTerminal(stderr) {
		progress = stderr
	}
	_, err := bench.Run(ctx, cfg, stdout, progress)
	if errors.Is(err, bench.ErrInvalid) {
		fmt.Fprintf(stderr, "pdq bench: %v\n", err)
		return errUsage
	}
	return err
}
