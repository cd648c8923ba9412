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
REPLACE ?=

.PHONY: setup test test-fast reproduce bench lint clean gpu-campaign wheelhouse mamba-sources mamba-wheels gpu-speed

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
	$(VENV)/bin/pytest -q --durations=25 tests

# The unit tier, a developer's inner loop (under 3 min on 2 cores): no integration module, no slow test.
test-fast: setup
	$(VENV)/bin/pytest -q --durations=10 -m "not integration and not slow" tests

lint: setup
	$(VENV)/bin/ruff check ttt_bench cli kernels tests

reproduce: setup
	$(PY) -m ttt_bench.reproduce --profile $(PROFILE) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(if $(STEPS),--steps $(STEPS)) --jobs $(JOBS) $(if $(REPLACE),--replace)

# The speed figures of the README (docs/speed.md): every suite at the CPU reference size, into results/speed/.
bench: SHELL := /bin/bash
bench: .SHELLFLAGS := -eo pipefail -c
bench: setup
	mkdir -p results/speed
	$(VENV)/bin/ttt-bench bench models --preset cpu-ref --repeats 5 --out results/speed/models.csv | tee results/speed/models.txt
	$(VENV)/bin/ttt-bench bench forms --repeats 5 --out results/speed/forms.csv | tee results/speed/forms.txt
	$(VENV)/bin/ttt-bench bench scan --out results/speed/scan.csv | tee results/speed/scan.txt

# The GPU campaign (docs/gpu_campaign.md): STAGE=check|bench|train|figure3|all into OUT; finished
# stages are skipped (FORCE=1 runs them again); DRY=1 runs it tiny on the CPU (as make test does).
STAGE ?= all
OUT ?= results/gpu
FORCE ?=
DRY ?=
gpu-campaign: setup
	$(PY) -m ttt_bench.campaign --stage $(STAGE) --out $(OUT) $(if $(FORCE),--force) $(if $(DRY),--dry)

# The TTT-Linear prefill kernel on a GPU node (scripts/gpu_speed.sh, at most 8 minutes, the node's python3):
# checked against float64, then timed against the chunk kernel; its files into GPU_SPEED_DIR (default $OUT,
# else /tmp/ttt-gpu-speed).
GPU_SPEED_DIR ?=
gpu-speed:
	bash scripts/gpu_speed.sh $(GPU_SPEED_DIR)

# Offline GPU nodes (docs/offline.md). On a machine with internet, every wheel the toolkit needs beyond a
# GPU image's base stack (torch, triton, lightning, numpy, pandas, matplotlib), for the node's Python (PY)
# and wheel platform (PLATFORM), default this machine's, with a MANIFEST.txt that says how to install it:
#   make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64 WHEELHOUSE=wheelhouse [WHEEL_EXTRAS=slurm]
# PY here names the node's Python version: the recipes run $(VENV)/bin/python all the same.
WHEELHOUSE ?= wheelhouse
PLATFORM ?=
WHEEL_EXTRAS ?=
WHEEL_PY := $(if $(filter command line,$(origin PY)),$(PY))
WHEEL_TARGET = $(if $(WHEEL_PY),--python $(WHEEL_PY)) $(if $(PLATFORM),--platform $(PLATFORM))
wheelhouse mamba-sources mamba-wheels: override PY := $(VENV)/bin/python
wheelhouse: setup
	$(PY) -m ttt_bench.wheelhouse $(WHEEL_TARGET) --out $(WHEELHOUSE) $(if $(WHEEL_EXTRAS),--extras $(WHEEL_EXTRAS))

# mamba-ssm and causal-conv1d (the cuda extra) have only sources on PyPI and compile against the node's
# torch. mamba-wheels (online, needs nvcc, no GPU): a Python 3.12 (PY) build venv in MAMBA_BUILD/venv, made
# once, with PyPI's CUDA torch NODE_TORCH, then their wheels for CUDA_ARCH only (setup.py patched), stripped,
# into WHEELHOUSE, at nice 19 with MAX_JOBS nvcc processes, e.g. make mamba-wheels CUDA_ARCH=8.0 (A100);
# LINEINFO=1 keeps nvcc's -lineinfo (profilers' source view; wheels about 4 times as big).
# With NODE_PYTHON (a Python with the node's CUDA torch, no network needed): built with it instead, from the
# sources and wheels of mamba-sources (online: their sources into WHEELHOUSE/src, the wheels they need).
CUDA_ARCH ?= 9.0
NODE_TORCH ?= 2.11.0
NODE_PYTHON ?=
BUILD_PYTHON ?=
MAMBA_BUILD ?= .cache/mamba-build
MAX_JOBS ?= 2
LINEINFO ?=
mamba-sources: setup
	$(PY) -m ttt_bench.wheelhouse --step mamba-sources $(WHEEL_TARGET) --out $(WHEELHOUSE)

MAMBA_ARGS = --step mamba-wheels --cuda-arch '$(CUDA_ARCH)' --out $(WHEELHOUSE) --build-dir $(MAMBA_BUILD) \
	$(if $(LINEINFO),--lineinfo)
mamba-wheels: $(if $(NODE_PYTHON),,setup)
ifneq ($(NODE_PYTHON),)
	$(if $(wildcard $(WHEELHOUSE)/src/*.tar.gz),,$(MAKE) mamba-sources)
	MAX_JOBS=$(MAX_JOBS) nice -n 19 $(NODE_PYTHON) -m ttt_bench.wheelhouse $(MAMBA_ARGS)
else
	MAX_JOBS=$(MAX_JOBS) nice -n 19 $(VENV)/bin/python -m ttt_bench.wheelhouse $(MAMBA_ARGS) --build-venv \
		--python $(or $(WHEEL_PY),3.12) --torch $(NODE_TORCH) $(if $(BUILD_PYTHON),--build-python $(BUILD_PYTHON))
endif

clean:
	rm -rf $(VENV) runs .cache
