# pdq: two commands do all the set-up on a fresh machine:
#   make run    run pdq
#   make test   run the whole test suite
GO        ?= go
BIN       := bin/pdq
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

.DEFAULT_GOAL := help
.PHONY: help build run test fmt-check vet lint fuzz clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## build bin/pdq
	$(GO) build -o $(BIN) ./cmd/pdq

run: build ## run pdq (until the pipeline lands: one simulated engine on 127.0.0.1:8100)
	./$(BIN) sim

test: fmt-check vet ## run the whole test suite with the race detector
	$(GO) test -race -count=1 -timeout 10m ./...

fmt-check: ## fail if a file is not gofmt-formatted
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "not gofmt-formatted:"; echo "$$out"; exit 1; fi

vet: ## go vet
	$(GO) vet ./...

lint: fmt-check vet ## gofmt, go vet and staticcheck
	$(GO) run $(STATICCHECK) ./...

fuzz: ## fuzz request parsing for 60s
	$(GO) test -run '^$$' -fuzz FuzzDecodeRequest -fuzztime 60s ./pkg/openai

clean: ## remove build output
	rm -rf bin
