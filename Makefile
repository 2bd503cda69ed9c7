# Two entry points (see README.md): `make run` and `make test`. Both create or reuse .venv and
# install what they need; a stamp file keyed on pyproject.toml makes the second run fast.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specula-installed
QUESTION ?= What colour is the star? Answer with one word.
IMAGE ?= world/assets/sample.png

.PHONY: run serve test install clean-venv

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/specula generate --image "$(IMAGE)" --question "$(QUESTION)"

serve: $(STAMP)
	$(BIN)/specula serve $(if $(CONFIG),--config "$(CONFIG)",)

test: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q --timeout=900 tests research/tests

clean-venv:
	rm -rf $(VENV)
