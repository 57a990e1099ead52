# gemmajax: `make test` sets everything up in .venv and runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export JAX_PLATFORMS ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-slow test-all serve bench tpu-table lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(BIN)/python -m pip install -q -e '.[test,tpu,default-model]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# Two pytest-xdist workers, one test file each at a time (a file's module fixtures are built once): most tests
# wait on single-threaded XLA compiles, so the suite took 24 min against 35 serially on 2 cores (2026-12-06), and
# 21-22 min once it compiled at LLVM -O0 (tests/xla_flags.py; GEMMAJAX_TEST_XLA_OPT=default for XLA's default level).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

# Full-size TPU compiles (deviceless, through libtpu) and other long checks.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m slow tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "slow or not slow" tests

serve: $(STAMP)
	$(BIN)/gemmajax serve $(SERVE_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/compare_cpu.py

# The TPU fit table (every published size x quant mode x chip, deviceless compiles through libtpu; minutes).
tpu-table: $(STAMP)
	$(BIN)/python bench/fit_table.py --out docs/fit_table.md

lint: $(STAMP)
	$(BIN)/python -m ruff check gemmajax tests bench || true

clean:
	rm -rf $(VENV) .pytest_cache
