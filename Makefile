# aenv: `make serve` installs what is missing and runs a node on 127.0.0.1:8000;
# `make test` installs what is missing and runs the suite. Both are idempotent:
# stamps under .state/ record what is done, so a second run installs nothing.

SHELL := /bin/bash
.DEFAULT_GOAL := help
ROOT := $(abspath .)
STATE := $(ROOT)/.state
VENV := $(ROOT)/.venv
PY := $(VENV)/bin/python
PYTHON_BASE ?= /usr/bin/python3
AENV_HOME ?= $(if $(filter 0,$(shell id -u)),/var/lib/aenv,$(HOME)/.local/state/aenv)
TEST_HOME ?= $(STATE)/test-home
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help deps apt venv bundle templates serve test test-fast test-slow lint fuzz bench clean

help:
	@echo "make serve      install what is missing, run a node on 127.0.0.1:8000 (AENV_LISTEN overrides)"
	@echo "make test       install what is missing, run the whole default suite"
	@echo "make test-slow  long suites (debootstrap build of the base template from scratch, ...)"
	@echo "make lint       ruff, mypy --strict, import-linter"
	@echo "make fuzz       long fuzz runs"
	@echo "make bench      benchmarks (bench/), p50/p95 next to the runsc floor"

$(STATE):
	@mkdir -p $(STATE)

# -- system packages ----------------------------------------------------------
apt:
	@scripts/install-deps

# -- Python environment ---------------------------------------------------------
$(STATE)/venv.stamp: pyproject.toml | $(STATE)
	@echo "==> creating virtualenv $(VENV) with the project and dev tools"
	@test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' --progress-bar on
	@touch $@
venv: apt
	@$(MAKE) --no-print-directory $(STATE)/venv.stamp

deps: apt venv

# -- node artefacts -------------------------------------------------------------
bundle: venv
	@$(PY) -m aenv.storage.bundle $(AENV_HOME)/bundle

# With AENV_STORE_URL set, templates another node shared there are fetched, not built.
templates: venv
	@$(PY) -m aenv.storage.rootfs --home $(AENV_HOME) --from-store "$(AENV_STORE_URL)"

serve: deps bundle templates
	@AENV_HOME=$(AENV_HOME) $(VENV)/bin/aenv serve

# -- tests ----------------------------------------------------------------------
test-artefacts: venv
	@$(PY) -m aenv.storage.bundle $(TEST_HOME)/bundle
	@$(PY) -m aenv.storage.rootfs --home $(TEST_HOME)

$(STATE)/npm.stamp: tests/js/package.json | $(STATE)
	@echo "==> installing the e2b npm SDK for the JS tests"
	@cd tests/js && npm install --no-audit --no-fund --loglevel=error
	@touch $@

test: deps test-artefacts $(STATE)/npm.stamp
	@AENV_TEST_HOME=$(TEST_HOME) $(PY) -m pytest -m "not slow" -p no:cacheprovider $(PYTEST_ARGS) tests fuzz

test-fast: venv
	@$(PY) -m pytest -m "not slow and not runsc" -p no:cacheprovider $(PYTEST_ARGS) tests fuzz

test-slow: deps test-artefacts
	@AENV_TEST_HOME=$(TEST_HOME) $(PY) -m pytest -m slow -p no:cacheprovider $(PYTEST_ARGS) tests

lint: venv
	@$(VENV)/bin/ruff check aenv tests fuzz bench
	@$(VENV)/bin/mypy
	@$(VENV)/bin/lint-imports

fuzz: venv
	@AENV_FUZZ_LONG=1 $(PY) -m pytest -p no:cacheprovider fuzz

bench: deps test-artefacts
	@AENV_TEST_HOME=$(TEST_HOME) $(PY) bench/run.py
	@AENV_TEST_HOME=$(TEST_HOME) $(PY) bench/forks.py

clean:
	rm -rf $(STATE) $(VENV)
