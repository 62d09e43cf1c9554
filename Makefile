# Every target bootstraps .venv from pyproject.toml when it is missing or older than pyproject.toml.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/broker serve

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m bench

.PHONY: crash
crash: $(STAMP)  # kill -9 a loaded server 100 times and check nothing acknowledged is lost
	$(BIN)/python -m bench.crash

.PHONY: audit
audit: $(STAMP)  # check the journal in ./snapshots/ with Spark (docs/audit.md); needs Java 17+
	$(BIN)/python -m tools.journal_audit audit snapshots/

$(BENCH_STAMP): $(STAMP)  # the peers' clients: bench.peers runs them, and mypy checks bench/ against them
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

lint: $(BENCH_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: bench-peers
bench-peers: $(BENCH_STAMP)  # the broker against beanstalkd, Redis and PostgreSQL (installs them with apt-get if missing)
	$(BIN)/python -m bench.peers $(ARGS)
