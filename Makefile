# Two commands on a fresh machine: `make reproduce` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PROFILE ?= cpu
DATA_DIR ?=
EXTRAS ?= dev

.PHONY: setup test reproduce lint clean

# The pinned torch goes in first: on CPU machines it is the local CPU wheel; an unpinned torch
# would pull several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(VENV)/bin/pytest -q tests

lint: setup
	$(VENV)/bin/ruff check ttt_bench cli kernels tests

reproduce: setup
	$(PY) -m ttt_bench.reproduce --profile $(PROFILE) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

clean:
	rm -rf $(VENV) runs .cache
