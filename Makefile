# The two commands of the README. Each creates (or reuses) .venv and installs the pinned requirements once.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat requirements/ci.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test
demo: $(STAMP)
	$(VENV)/bin/ioattn demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

$(STAMP): requirements/ci.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements/ci.txt
	$(VENV)/bin/python -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@
