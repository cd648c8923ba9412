# Two commands on a fresh machine: `make reproduce` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PROFILE ?= quick
STEPS ?=
JOBS ?= 2
DATA_DIR ?=
EXTRAS ?= dev

.PHONY: setup test reproduce bench lint clean gpu-campaign

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
	$(PY) -m ttt_bench.reproduce --profile $(PROFILE) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(if $(STEPS),--steps $(STEPS)) --jobs $(JOBS)

# The speed figures of the README (docs/speed.md): every suite at the CPU reference size, into results/speed/.
bench: SHELL := /bin/bash
bench: .SHELLFLAGS := -eo pipefail -c
bench: setup
	mkdir -p results/speed
	$(VENV)/bin/ttt-bench bench models --preset cpu-ref --repeats 5 --out results/speed/models.csv | tee results/speed/models.txt
	$(VENV)/bin/ttt-bench bench forms --repeats 5 --out results/speed/forms.csv | tee results/speed/forms.txt
	$(VENV)/bin/ttt-bench bench scan --out results/speed/scan.csv | tee results/speed/scan.txt

# The first GPU session's campaign (docs/gpu_campaign.md): STAGE=check|bench|train|all into OUT; finished
# stages are skipped (FORCE=1 runs them again); DRY=1 runs it tiny on the CPU (as make test does).
STAGE ?= all
OUT ?= results/gpu
FORCE ?=
DRY ?=
gpu-campaign: setup
	$(PY) -m ttt_bench.campaign --stage $(STAGE) --out $(OUT) $(if $(FORCE),--force) $(if $(DRY),--dry)

clean:
	rm -rf $(VENV) runs .cache
