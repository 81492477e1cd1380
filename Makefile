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
# and iproute2's ip) each run beside the rest of the suite, in lanes of
# their own: their rows mostly wait (outages, partitions, leases,
# time-outs), so the three take about the time of the longest rather than
# the sum (on 2 cores: the e2e tests 4.5 min, the fault suite 4.5 min, the
# cluster tests 3.5 min alone). Their output is printed whole once all end;
# any failing fails the target.
FAULTS := ^TestFaultSuite$$
CLUSTER := ^TestCluster
test: fmt-check vet openai-client ## run the whole test suite with the race detector, the fault suite and the cluster tests beside it
	$(GO) test -count=1 -tags pdqnext -run 'TestNextEnvelope|TestEnvelopeReadsAs' ./dispatcher/
	@faults=$$(mktemp); cluster=$$(mktemp); \
	echo "$(GO) test -race -count=1 -timeout 12m -run '$(FAULTS)' -v ./tests/ (beside; its output follows)"; \
	$(GO) test -race -count=1 -timeout 12m -run '$(FAULTS)' -v ./tests/ >$$faults 2>&1 & fpid=$$!; \
	echo "$(GO) test -race -count=1 -timeout 12m -run '$(CLUSTER)' -v ./tests/ (beside; its output follows)"; \
	$(GO) test -race -count=1 -timeout 12m -run '$(CLUSTER)' -v ./tests/ >$$cluster 2>&1 & cpid=$$!; \
	echo "PDQ_REQUIRE_OPENAI_CLIENT=1 $(GO) test -race -count=1 -timeout 12m -skip '$(FAULTS)|$(CLUSTER)' ./..."; \
	PDQ_REQUIRE_OPENAI_CLIENT=1 $(GO) test -race -count=1 -timeout 12m -skip '$(FAULTS)|$(CLUSTER)' ./...; rc=$$?; \
	wait $$fpid; frc=$$?; wait $$cpid; crc=$$?; \
	echo "--- the fault suite:"; cat $$faults; echo "--- the cluster tests:"; cat $$cluster; rm -f $$faults $$cluster; \
	if [ $$rc -ne 0 ] || [ $$frc -ne 0 ] || [ $$crc -ne 0 ]; then \
		echo "make test: FAILED (suite exit $$rc, fault suite exit $$frc, cluster tests exit $$crc)"; exit 1; fi

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
