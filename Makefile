# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(PY) -m fdq.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) bench/engine.py
