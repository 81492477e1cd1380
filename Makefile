# pdq: two commands do all the set-up on a fresh machine:
#   make run    run pdq
#   make test   run the whole test suite
GO        ?= go
BIN       := bin/pdq
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

.DEFAULT_GOAL := help
.PHONY: help build run test faults cluster-test bench bench-cluster microbench openai-client fmt-check vet lint fuzz clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# -buildvcs=auto: pdq version names the commit, whatever GOFLAGS says.
build: ## build bin/pdq
	$(GO) build -buildvcs=auto -o $(BIN) ./cmd/pdq

# make run binds the gateway to loopback; set PDQ_HTTP_ADDR=:8000 to serve
# other machines.
export PDQ_HTTP_ADDR ?= 127.0.0.1:8000

run: build ## run pdq up: embedded NATS, gateway, workers, simulated engines unless PDQ_*_ENGINES are set
	./$(BIN) up

# The fault suite and the cluster tests (hosts in network namespaces, root
# and iproute2's ip) run beside the rest of the suite: their rows mostly
# wait (outages, partitions, leases, time-outs), so the two take about the
# time of the longer rather than the sum (on 2 cores: the e2e tests 4.5
# min, the fault suite and the cluster tests 8 min, 8.5 min together). A
# third lane, the cluster tests apart, saved 15 s and made the fault
# suite's heaviest row (16 bodies of 1 MB against a full disk) slow past
# its clients' bound. Their output is printed whole once both end; either
# failing fails the target.
BESIDE := ^(TestFaultSuite|TestCluster.*)$$
test: fmt-check vet openai-client ## run the whole test suite with the race detector, the fault suite and the cluster tests beside it
	$(GO) test -count=1 -tags pdqnext -run 'TestNextEnvelope|TestEnvelopeReadsAs' ./dispatcher/
	@faults=$$(mktemp); \
	echo "$(GO) test -race -count=1 -timeout 14m -run '$(BESIDE)' -v ./tests/ (beside; its output follows)"; \
	$(GO) test -race -count=1 -timeout 14m -run '$(BESIDE)' -v ./tests/ >$$faults 2>&1 & fpid=$$!; \
	echo "PDQ_REQUIRE_OPENAI_CLIENT=1 $(GO) test -race -count=1 -timeout 10m -skip '$(BESIDE)' ./..."; \
	PDQ_REQUIRE_OPENAI_CLIENT=1 $(GO) test -race -count=1 -timeout 10m -skip '$(BESIDE)' ./...; rc=$$?; \
	wait $$fpid; frc=$$?; echo "--- the fault suite and the cluster tests:"; cat $$faults; rm -f $$faults; \
	if [ $$rc -ne 0 ] || [ $$frc -ne 0 ]; then echo "make test: FAILED (suite exit $$rc, fault suite and cluster tests exit $$frc)"; exit 1; fi

faults: ## run the fault suite alone and print its table (docs/reliability.md)
	$(GO) test -count=1 -timeout 8m -run '^TestFaultSuite$$' -v ./tests/

cluster-test: ## run the tests across hosts of their own (network namespaces; needs root and iproute2): partitions
	$(GO) test -race -count=1 -timeout 15m -run '^TestCluster' -v ./tests/

bench: ## side by side: engine alone, the floor, a plain P/D proxy, pdq up at BASE (default 62e80c5) and at HEAD, on pdq sim engines; then HEAD and the proxy against the targets
	$(GO) run ./tools/sidebyside $(if $(BASE),-base $(BASE)) $(if $(REPEAT),-repeat $(REPEAT))

bench-cluster: ## scheduling side by side: pdq, pdq with affinity off, a round-robin and a least-loaded P/D proxy in front of 4+4 simulated engines (seed profile), five workloads over a sweep of rates; then the targets of issue 27 and a plot a workload in bin/bench-cluster (ARGS="-quick" for one rate each)
	$(GO) run ./tools/benchcluster $(ARGS)

microbench: ## go test -bench of the hot pieces, with allocations, and the durable path alone
	$(GO) test -run '^$$' -bench . -benchmem ./pkg/jsonobj ./pkg/openai ./pkg/nixl ./dispatcher/... ./workers

openai-client: ## install the pinned official OpenAI Node client that the suite drives
	npm ci --prefix tests/openai-client --no-audit --no-fund --loglevel=error

fmt-check: ## fail if a file is not gofmt-formatted
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "not gofmt-formatted:"; echo "$$out"; exit 1; fi

vet: ## go vet
	$(GO) vet ./...

lint: fmt-check vet ## gofmt, go vet and staticcheck
	$(GO) run $(STATICCHECK) ./...

fuzz: ## fuzz request parsing and the reply frame for 60s each
	$(GO) test -run '^$$' -fuzz FuzzDecodeRequest -fuzztime 60s ./pkg/openai
	$(GO) test -run '^$$' -fuzz FuzzDecodeFast -fuzztime 60s ./pkg/openai
	$(GO) test -run '^$$' -fuzz FuzzParseRequest -fuzztime 60s ./gateway
	$(GO) test -run '^$$' -fuzz FuzzReplyFrame -fuzztime 60s ./dispatcher/reply

clean: ## remove build output, local data and installed test packages
	rm -rf bin data tests/openai-client/node_modules
