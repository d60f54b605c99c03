# CoSine: the two contract commands are `make run` (local cluster + demo workload) and
# `make test` (the test suite). Both set everything up idempotently on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.cosine-installed
PROTOS := $(wildcard protos/cosine/v1/*.proto)
PB_STAMP := pb/.generated

.PHONY: setup proto redis-server kernels lint format test fuzz run bench container-tools images compose-check chart-check clean help

help:
	@echo "make run    - set up, start the local cluster and serve a demo workload"
	@echo "make test   - set up, lint (ruff) and run the test suite"
	@echo "make lint   - ruff's lint and format check; make format rewrites the code in ruff's format"
	@echo "make fuzz   - set up and fuzz every service's gRPC and HTTP inputs at length (over 15,000 cases)"
	@echo "make bench  - set up, build the default zoo if absent, run every system and write bench-out/report.json + plots"
	@echo "make images - build the CPU images (docker/Dockerfile, every target) with podman or docker"
	@echo "make compose-check - run docker-compose.yml's cluster in containers (tiny zoo) and check it; not part of make test"
	@echo "make chart-check - run the Helm chart's pods (helm template, small profile) in containers and check them"
	@echo "make proto  - regenerate the gRPC/protobuf code (pb/) from protos/"
	@echo "make kernels - build and cache the project's C++ CPU kernels for this CPU (part of setup)"
	@echo "make clean  - remove the virtual environment and generated code"

setup: $(STAMP) redis-server kernels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# grpcio-tools first: the package discovery of the project install needs pb/ generated.
$(PB_STAMP): $(PROTOS) constraints.txt | $(BIN)/python
	$(PIP) grpcio-tools
	rm -rf pb && mkdir -p pb
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=pb --pyi_out=pb --grpc_python_out=pb $(PROTOS)
	touch pb/cosine/__init__.py pb/cosine/v1/__init__.py
	touch $@

proto: $(PB_STAMP)

$(STAMP): pyproject.toml constraints.txt $(PB_STAMP)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,bench,zoo]'
	touch $@

# The project's C++ CPU kernels, built for this CPU and cached so that no request waits for the
# compiler; a cached build only loads. Where they cannot be built, one line says why and the
# services use torch's kernels (the command still succeeds).
kernels: $(STAMP)
	@$(BIN)/cosine kernels build

# Debian's redis-server, installed when missing (tests and `cosine up` start private ones).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server is still missing; install it and retry" >&2; exit 1; }

# ruff: lint and the format check (pyproject.toml's [tool.ruff]); `make format` rewrites in place.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix --select I .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The long fuzzing run: tests/fuzz under the `fuzz` hypothesis profile (1,000 random cases per
# target instead of the 50 derandomized ones of `make test`); prints the cases run per target and
# the result. Failing examples are kept in .hypothesis/ and replayed first next time.
fuzz: setup
	$(BIN)/python -m pytest -q tests/fuzz --hypothesis-profile=fuzz $(FUZZ_ARGS)

run: setup
	$(BIN)/cosine demo $(RUN_ARGS)

# The full benchmark (about 20-27 minutes on 2 cores once the zoo exists): every baseline, CoSine
# and its ablations on the same workloads; report and plots in bench-out/.
BENCH_ZOO ?= .cosine/zoo-smol
bench: setup
	@test -f $(BENCH_ZOO)/zoo.json || $(BIN)/cosine models build --profile smol --out $(BENCH_ZOO)
	$(BIN)/cosine bench --zoo $(BENCH_ZOO) --out bench-out/report.json $(BENCH_ARGS)

# The CPU images (tools, drafter, verifier, router, gateway) with podman, or docker where podman is
# missing; from a local Debian base (debootstrap, made once) where the default base cannot be
# pulled; the build's pip uses this machine's pip configuration (deploy/images.sh).
# Debian's podman, runc and debootstrap, installed when missing (as redis-server is above).
container-tools:
	@command -v podman >/dev/null 2>&1 || command -v docker >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || { \
	  echo "installing podman, runc and debootstrap (Debian packages)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq podman runc debootstrap >/dev/null; }

images: container-tools
	PIP="$(if $(wildcard $(BIN)/pip),$(BIN)/pip,)" deploy/images.sh build

# docker-compose.yml's cluster in containers on this machine, with the tiny zoo, then checked:
# greedy outputs through the SDK and the openai client, /metrics, a container killed under load;
# everything torn down (deploy/compose_check.py; about 10 minutes once the images exist).
compose-check: setup
	PIP="$(BIN)/pip" $(BIN)/python -m deploy.compose_check $(CHECK_ARGS)

# The Helm chart's pods, rendered by Helm's library for a small profile (tiny zoo, one replica each,
# the images built here), run as containers on this machine with the same checks as compose-check
# (deploy/chart_check.py; what this leaves unverified against a real cluster: docs/deployment.md).
chart-check: setup
	$(BIN)/python -m deploy.chart_check $(CHECK_ARGS)

clean:
	rm -rf $(VENV) pb
