# dmuon_edu: the two commands a learner needs are `make lab` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Pinned, tested versions (torch is the CPU build). A GPU user empties it:
# `make install CONSTRAINTS=` lets pip choose the torch build for the machine.
CONSTRAINTS ?= constraints.txt
INSTALLED := $(VENV)/.installed-$(if $(CONSTRAINTS),pinned,unpinned)
# Python's bytecode cache, kept inside the venv (never beside the sources). Where PYTHONDONTWRITEBYTECODE is set,
# as on some machines, no cache was written and every process (each rank, kernel, test worker) compiled torch's
# source again: importing torch and FSDP took 6.6 CPU-s instead of 2.4 on 2 cores.
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install lab test notebooks solutions check bench gpu-check clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing dmuon_edu and its course tools into $(VENV) ..."
	@# --no-compile: Python compiles a module when it is first imported (into PYTHONPYCACHEPREFIX); compiling every
	@# installed file up front took a minute.
	@# The machine's pip configuration names extra package folders that may be absent; hide pip's noise about them.
	@$(PY) -m pip install --quiet --no-compile --disable-pip-version-check $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[course,test]' 2>&1 | { grep -v 'is ignored: it is neither' || true; }
	@rm -f $(VENV)/.installed-*
	@touch $@

## Start JupyterLab on the course (prints its URL; opens a browser where there is one).
# .jupyter/ is the course's own JupyterLab configuration, added to the search path (your ~/.jupyter
# still applies, and wins): it turns off the "get notified about Jupyter news?" prompt on first open.
LAB_CONFIG_PATH := $(CURDIR)/.jupyter$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH))
lab: install
	JUPYTER_CONFIG_PATH="$(LAB_CONFIG_PATH)" $(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
		--ServerApp.default_url=/lab/tree/notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

## The whole suite, stage by stage, with the time each stage took.
test:
	@bash tests/stages.sh

# FORCE=1 lets `make notebooks` and `make solutions` replace learner files you changed, each after a backup.
FORCE_FLAG = $(if $(filter-out 0 1,$(FORCE)),$(error FORCE is 1 or 0, not '$(FORCE)'),$(if $(filter 1,$(FORCE)),--force))

## Rewrite the learner notebooks from the solutions. A file you changed is never replaced,
## unless FORCE=1, and then only after a backup (<name>.bak-<time>, beside it).
notebooks: install
	$(PY) -m dmuon_edu.course build $(FORCE_FLAG)

## Re-run the solution notebooks and store their (clean) outputs; then rebuild notebooks/ (FORCE=1 as above).
solutions: install
	$(PY) -m dmuon_edu.course execute $(NB)
	$(PY) -m dmuon_edu.course build $(FORCE_FLAG)

## Grade your work in notebooks/: one row per exercise (NB=01 for one module).
## A cell that runs longer than CELL_TIMEOUT seconds (default 120) stops its notebook.
check: install
	@$(PY) -m dmuon_edu check $(if $(CELL_TIMEOUT),--cell-timeout $(CELL_TIMEOUT)) $(NB)

## Every benchmark in one run: one markdown table of ratios, printed and written to benchmarks/results.md.
## CPU rows take under 10 minutes on 2 cores; with CUDA the GPU rows are added.
bench: install
	$(PY) benchmarks/run_all.py

## For whoever has a GPU: every CUDA-marked test and the GPU benchmark rows, under 8 minutes on one GPU.
## No install: the interpreter already there (GPU_PYTHON) needs torch, pytest and tqdm only.
GPU_PYTHON ?= python3
GPU_TESTS := tests/test_newton_schulz.py tests/test_muon.py tests/test_memory.py tests/test_gpt.py tests/test_dmuon.py
gpu-check:
	@PYTHONPATH="$(CURDIR)" $(GPU_PYTHON) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "make gpu-check needs a CUDA GPU, and torch " + torch.__version__ + " sees none (GPU_PYTHON=$(GPU_PYTHON)); name an interpreter with a CUDA build of torch: make gpu-check GPU_PYTHON=/path/to/python")'
	PYTHONPATH="$(CURDIR)" $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m cuda $(GPU_TESTS)
	PYTHONPATH="$(CURDIR)" $(GPU_PYTHON) benchmarks/run_all.py --gpu-only --out benchmarks/results-gpu.md

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
