# Two commands on a fresh machine (see README.md): `make test` and `make train`. Each sets itself up: a
# virtual environment in .venv with this package installed in editable mode, every dependency at the version
# pinned in constraints/lock.txt, so a newcomer gets exactly the set CI tested. Nothing is needed beforehand
# but python3 (>= 3.11) and make.
#
# Three environments, one command each (CI runs all three, each in a fresh environment):
#   make test          the locked set (constraints/lock.txt), in .venv
#   make test-oldest   every dependency at the floor pyproject.toml declares (constraints/oldest.txt), without
#                      the onnx, serve, trl and runtimes extras (their tests say they skip)
#   make test-newest   the newest release of everything the registry offers, torch included
# When the newest set passes, `make lock` moves the lock forward to it; `make test` then tests the new lock.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and on its own, so that the build can be chosen: 2.13.0 is a CPU build on the
# project's CI machines. Elsewhere pass e.g. TORCH=torch to take the build that suits your machine.
TORCH ?= torch==2.13.0
LOCK := constraints/lock.txt
OLDEST := constraints/oldest.txt
STAMP := $(VENV)/.deriv-installed
PIP := -m pip install --quiet --disable-pip-version-check
# `make setup` shows what pip does (a line per package, download bars on a terminal): its first run takes minutes,
# and a silent one looks hung. subtle: $(shell) captures stdout, so the terminal test looks at stderr.
SETUP_PIP := -m pip install --disable-pip-version-check --progress-bar $(shell test -t 2 && echo on || echo off)

.PHONY: setup test test-oldest test-newest test-all lock train train-translation lint lint-imports bench \
	bench-seq2seq bench-tokenizer browser clean test-llamacpp

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	@echo "setup: creating $(VENV) (a virtual environment for $(PYTHON))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup: installing $(TORCH) (the CPU build on this project's CI machines; about a minute)"
	$(PY) -c "import torch" 2>/dev/null || $(PY) $(SETUP_PIP) "$(TORCH)"
	@echo "setup: installing deriv-lm and its dependencies at the versions in $(LOCK) (a few minutes)"
	$(PY) $(SETUP_PIP) -c $(LOCK) -e ".[dev,viz,onnx,serve,trl,eval,runtimes]"
	touch $(STAMP)
	@echo "setup: done; $(VENV)/bin/deriv is the deriv command"

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The oldest set: torch 2.7 is a CUDA build from PyPI here (about 3 GB, a minute to install); the tests run
# it on the CPU. Rebuilt whenever the floors or the package's requirements change.
.venv-oldest/.deriv-installed: pyproject.toml $(OLDEST)
	rm -rf .venv-oldest
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python $(PIP) -c $(OLDEST) torch
	.venv-oldest/bin/python $(PIP) -c $(OLDEST) -e ".[dev,viz]"
	touch $@

test-oldest: .venv-oldest/.deriv-installed
	.venv-oldest/bin/python -m pytest -q $(PYTEST_ARGS)

# The newest set, always built afresh. PIP_CONFIG_FILE=/dev/null sets aside pip's configuration files, so
# that a machine-wide cap or local mirror (this project's CI machines cap torch at the builds on their disk)
# does not hold back the newest releases.
test-newest:
	rm -rf .venv-newest
	$(PYTHON) -m venv .venv-newest
	PIP_CONFIG_FILE=/dev/null .venv-newest/bin/python $(PIP) --upgrade pip
	PIP_CONFIG_FILE=/dev/null .venv-newest/bin/python $(PIP) torch
	PIP_CONFIG_FILE=/dev/null .venv-newest/bin/python $(PIP) --upgrade --upgrade-strategy eager -e ".[dev,viz,onnx,serve,trl,eval,runtimes]"
	.venv-newest/bin/python -m pip freeze --exclude-editable > .venv-newest/freeze.txt
	.venv-newest/bin/python -m pytest -q $(PYTEST_ARGS)

test-all: test test-oldest test-newest

# llama.cpp through llama-cpp-python, for tests/test_llamacpp.py (a GGUF export decoded in llama.cpp): its own
# environment, the locked set plus llama-cpp-python, which compiles llama.cpp from source (about 13 minutes on 2
# cores the first time; pip's wheel cache makes the next build quick). Not in `make test`: too slow to build there.
LLAMA_CPP ?= llama-cpp-python==0.3.36
.venv-llamacpp/.deriv-installed: pyproject.toml $(LOCK)
	test -x .venv-llamacpp/bin/python || $(PYTHON) -m venv .venv-llamacpp
	.venv-llamacpp/bin/python -c "import torch" 2>/dev/null || .venv-llamacpp/bin/python $(PIP) "$(TORCH)"
	.venv-llamacpp/bin/python $(PIP) -c $(LOCK) -e ".[dev,runtimes]" "$(LLAMA_CPP)"
	touch $@

test-llamacpp: .venv-llamacpp/.deriv-installed
	.venv-llamacpp/bin/python -m pytest -q -s tests/test_llamacpp.py $(PYTEST_ARGS)

# Moves the lock to the set test-newest just passed with: every package but torch and the CUDA libraries it
# brings (torch is the build TORCH names) and the packaging tools. Keeps the lock's header. Run `make test` after.
lock:
	@test -f .venv-newest/freeze.txt || { echo "make lock: run make test-newest first"; exit 2; }
	{ sed -n '1,/^$$/p' $(LOCK); grep -viE '^(torch|triton|setuptools|pip)==|^(nvidia|cuda)-' .venv-newest/freeze.txt; } \
		> $(LOCK).new
	mv $(LOCK).new $(LOCK)

# The main job: a tokenizer and the `tiny` model on the embedded default corpus (minutes on 2 CPU cores).
train: setup
	$(VENV)/bin/deriv train lm $(TRAIN_ARGS)

# The translation model: the tiny preset on this machine's English->German gettext catalogs (about 8 minutes).
train-translation: setup
	$(VENV)/bin/deriv train translation $(TRAIN_ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The import contracts in pyproject.toml ([tool.importlinter]), on a mirror of the installed layout (the test
# builds it); its failure message is lint-imports' report.
lint-imports: setup
	$(PY) -m pytest -q tests/test_structure.py -k import_contracts

bench: setup
	$(VENV)/bin/deriv bench decoder $(BENCH_ARGS)

bench-seq2seq: setup
	$(VENV)/bin/deriv bench seq2seq $(BENCH_ARGS)

bench-tokenizer: setup
	$(VENV)/bin/deriv bench tokenizer $(BENCH_ARGS)

# The explorer's browser tests (tests/test_explore_browser.py) drive Debian's Chromium through its chromedriver,
# which they skip without (and CI, with DERIV_REQUIRE_BROWSER=1, fails without). This installs the two Debian
# packages with apt-get, through sudo unless you are root; Selenium is given their paths and downloads nothing.
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)
browser:
	@if test -x /usr/bin/chromium && test -x /usr/bin/chromedriver; then \
		echo "browser: /usr/bin/chromium and /usr/bin/chromedriver are installed"; \
	else \
		echo "browser: installing Debian's chromium and chromium-driver with apt-get (for the browser tests)"; \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
			chromium chromium-driver; \
	fi

clean:
	rm -rf $(VENV) .venv-oldest .venv-newest .venv-llamacpp build *.egg-info .pytest_cache
