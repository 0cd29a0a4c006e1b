# Two commands on a fresh machine (see README.md): `make test` and, from the training issue on,
# `make train`. Each sets itself up: a virtual environment in .venv with this package installed
# in editable mode. Nothing is needed beforehand but python3 (>= 3.10) and make.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and on its own, so that the build can be chosen: 2.13.0 is a CPU build
# on the project's CI machines. Elsewhere pass e.g. TORCH=torch to take the newest build for you.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.deriv-installed

.PHONY: setup test train train-translation lint bench bench-seq2seq bench-tokenizer clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,viz]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The main job: a tokenizer and the `tiny` model on the embedded default corpus (minutes on 2 CPU cores).
train: setup
	$(VENV)/bin/deriv train lm $(TRAIN_ARGS)

# The translation model: the tiny preset on this machine's English->German gettext catalogs (about 8 minutes).
train-translation: setup
	$(VENV)/bin/deriv train translation $(TRAIN_ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(VENV)/bin/deriv bench $(BENCH_ARGS)

bench-seq2seq: setup
	$(VENV)/bin/deriv bench-seq2seq $(BENCH_ARGS)

bench-tokenizer: setup
	$(VENV)/bin/deriv bench-tokenizer $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
