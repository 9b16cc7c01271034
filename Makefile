# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fedsec-installed
EXTRAS := agent,aggregator,audit,he,dev

.PHONY: venv system-deps test lint typecheck pytest bench demo clean

venv: $(STAMP)

# torch is pinned first when absent: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m fedsec.crypto.kernels  # compile the numba loops once, not in each test's first round
	touch $(STAMP)

# Debian packages the tests drive for real: Chromium (the dashboard's browser tests) and
# PostgreSQL (a member's SQL store, tests/support/postgres.py).
# Installed when we run as root; otherwise say so (with CI=true those tests then fail).
SYSTEM_PACKAGES := chromium postgresql
system-deps:
	@if command -v chromium >/dev/null 2>&1 && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null \
		|| { apt-get update -q >/dev/null && \
		     DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null; }; \
	else echo "note: $(SYSTEM_PACKAGES) missing and not root: browser and PostgreSQL tests will skip (fail with CI=true)"; fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q

bench: $(STAMP)
	mkdir -p bench/results
	bash bench/run.sh

# What moved since the recorded benchmark rows (fedsec bench compare); not part of test.
.PHONY: bench-check
bench-check: $(STAMP)
	$(BIN)/fedsec bench compare

demo: $(STAMP)
	$(BIN)/fedsec demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
