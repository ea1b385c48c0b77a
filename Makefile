# Two entry points for a newcomer: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.core-stamp
STAMP  := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
# uv with pip's own settings (indexes, find-links, constraints), pip where uv cannot be used:
# scripts/pip_install.py says which and why. TORSH_INSTALLER=pip asks for pip.
INSTALL := $(PY) scripts/pip_install.py

.PHONY: demo test install install-core system-deps lint clean gpu-check gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# What `make demo` needs: torch and the package with its required dependencies, no extras.
# torch is pinned here (the machine's CPU build); the package itself requires torch>=2.4.
$(CORE_STAMP): $(PY) pyproject.toml scripts/pip_install.py
	$(INSTALL) "torch==$(TORCH_VERSION)"
	$(INSTALL) -e .
	touch $(CORE_STAMP)

# Everything the test suite touches: every extra (Ray, Dask, Flower, Opacus, FastAPI, ...).
$(STAMP): $(CORE_STAMP)
	$(INSTALL) -e ".[dev,redis,monitor,plot,ray,dask,energy,federated,serve,hf,tracking,ft]"
	touch $(STAMP)

install-core: $(CORE_STAMP)

install: $(STAMP)

# Debian packages the integration tests use (redis-server, prometheus, chromium, SLURM, Open MPI); installed only
# when missing and when we are root with apt-get, otherwise those tests skip with a reason. `make test` installs
# them before the Python packages: mpi4py compiles against Open MPI's headers.
system-deps:
	@bash scripts/install-system-deps.sh

# Train the tiny GPT on 2 ranks (context 256 so that the 200-token sample fits; --resume never: a
# rerun trains afresh into the same directory), then continue a prompt with the checkpoint it saved.
# The demo preset and the sampling flags were chosen by measurement: benchmarks/bench_demo.py,
# docs/benchmarks.md ("The demo: which model a minute buys").
demo: install-core
	$(PY) -m compileall -q src > /dev/null
	$(VENV)/bin/torsh-dist train --nproc-per-node 2 --preset demo --checkpoint-dir runs/demo \
		--resume never
	$(VENV)/bin/torsh-dist generate --checkpoint runs/demo --prompt 'def main():\n    ' \
		--max-new-tokens 112 --temperature 0.9 --top-k 20 --seed 0

# --junitxml: every test's duration (runs/pytest-junit.xml, ignored by git) for finding where the
# suite's time goes; --durations prints the slowest. The suite runs on TEST_WORKERS pytest-xdist
# workers, a whole test file per worker at a time (--dist loadfile: module fixtures stay shared),
# the longest files first (--no-loadscope-reorder keeps tests/conftest.py's order, from
# tests/durations.json: refresh it with scripts/test_durations.py). No test races the wall clock
# (docs/testing.md), so none has to run alone.
# One test runs in place: `.venv/bin/python -m pytest tests/unit/test_pip_install.py`.
TEST_WORKERS ?= 2
# compileall: this package's modules as bytecode once, so that a host with PYTHONDONTWRITEBYTECODE
# set (this VM's shell) does not compile them from source again in every process the suite starts
# (~0.15 CPU s per trainer process measured; the installed packages have theirs from pip).
# PYTHONDONTWRITEBYTECODE= (empty: off) for the suite: with it set, pytest rewrites the asserts of
# every test module from source in each worker (no cache written): 19.8 s to collect against
# 10.2 s with the cache, measured; the caches land in the checkout's ignored __pycache__ folders.
test: system-deps install
	$(PY) -m compileall -q src > /dev/null
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 \
		--junitxml=runs/pytest-junit.xml tests

# The GPU check (docs/gpu.md): run on a machine with CUDA and PyTorch (the accelerator machine's
# image: no network there, so the wheels it lacks travel in .whl/, fetched here by gpu-wheels).
# Without CUDA it makes a dry pass of its steps (tests/unit/test_gpu_check.py runs that in CI).
gpu-wheels:
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl -r scripts/gpu_wheels.txt

gpu-check:
	python3 scripts/gpu_check.py --install

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
