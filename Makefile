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

.PHONY: install lab test notebooks solutions check bench clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing dmuon_edu and its course tools into $(VENV) ..."
	@# The machine's pip configuration names extra package folders that may be absent; hide pip's noise about them.
	@$(PY) -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[course,test]' 2>&1 | { grep -v 'is ignored: it is neither' || true; }
	@rm -f $(VENV)/.installed-*
	@touch $@

## Start JupyterLab on the course (prints its URL; opens a browser where there is one).
lab: install
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --ServerApp.default_url=/lab/tree/notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root)

## The whole suite, stage by stage, with the time each stage took.
test:
	@bash tests/stages.sh

## Rewrite the learner notebooks from the solutions.
notebooks: install
	$(PY) -m dmuon_edu.course build

## Re-run the solution notebooks and store their (clean) outputs; then rebuild notebooks/.
solutions: install
	$(PY) -m dmuon_edu.course execute $(NB)
	$(PY) -m dmuon_edu.course build

## Grade your work in notebooks/: one row per exercise (NB=01 for one module).
check: install
	@$(PY) -m dmuon_edu check $(NB)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
