# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
NSQJS := tests/broker/nsqjs

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# nsqjs (an NSQ client for Node) for the broker's real-client test; skipped without npm.
$(NSQJS)/node_modules/.installed: $(NSQJS)/package.json
	@if command -v npm >/dev/null 2>&1; then \
		cd $(NSQJS) && npm install --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: the nsqjs test will skip"; fi

.PHONY: demo test test-sqlite test-fdb bench
demo: $(VENV)/.installed
	$(PY) -m fdq.demo

# The suite twice: on the embedded engine (sqlite://), then on fdb:// through FoundationDB's
# official Python binding over the libfdb_c stand-in of tests/standin (FDQ_TEST_ENGINE=fdb).
# Two pytest-xdist workers (the machine's 2 cores): the multi-process tests spend much of
# their time waiting on timeouts and other processes. Every Spark test runs on one worker
# (tests/conftest.py), so one JVM starts.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup
test: $(VENV)/.installed $(NSQJS)/node_modules/.installed
	$(PYTEST)
	FDQ_TEST_ENGINE=fdb $(PYTEST)

test-sqlite: $(VENV)/.installed $(NSQJS)/node_modules/.installed
	$(PYTEST)

test-fdb: $(VENV)/.installed $(NSQJS)/node_modules/.installed
	FDQ_TEST_ENGINE=fdb $(PYTEST)

bench: $(VENV)/.installed
	$(PY) bench/engine.py
	$(PY) bench/queue_bench.py
