# Two entry points (see README.md): `make run` and `make test`. Both create or reuse .venv and
# install what they need; a stamp file keyed on pyproject.toml makes the second run fast.
# `make run` answers QUESTION about IMAGE with speculative decoding and the default drafter, then prints tau and the
# speedup over plain decoding of the same question in the same run (greedy, identical text checked);
# DRAFTER=none decodes plainly, DRAFTER=eagle (any kind) picks another drafter.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specula-installed
QUESTION ?= Describe the image in detail.
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
	$(BIN)/specula generate --image "$(IMAGE)" --question "$(QUESTION)" $(if $(DRAFTER),--drafter "$(DRAFTER)",)

serve: $(STAMP)
	$(BIN)/specula serve $(if $(CONFIG),--config "$(CONFIG)",)

# two workers, one thread each: most tests compute on one thread, so two files at a time use both cores of a small
# machine; each test file runs whole on one worker (its module fixtures are built once)
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --timeout=900 tests research/tests

clean-venv:
	rm -rf $(VENV)
