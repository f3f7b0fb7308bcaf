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

# Debian's Chromium and its driver for the dashboard's browser tests (tests/web), installed
# with apt-get where it runs as root (as on CI); elsewhere those tests skip, saying why.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium and chromium-driver for the browser tests"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
			>/dev/null; } || echo "could not install chromium: the browser tests will skip"; \
	else echo "no chromium and no apt-get as root to install it: the browser tests will skip"; fi

.PHONY: demo test test-sqlite test-fdb bench browser
demo: $(VENV)/.installed
	$(PY) -m fdq.demo

# The suite twice: on the embedded engine (sqlite://), then on fdb:// through FoundationDB's
# official Python binding over the libfdb_c stand-in of tests/standin (FDQ_TEST_ENGINE=fdb).
# Two pytest-xdist workers (the machine's 2 cores): the multi-process tests spend much of
# their time waiting on timeouts and other processes. Every Spark test runs on one worker
# (tests/conftest.py), so one JVM starts.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup
SETUP := $(VENV)/.installed $(NSQJS)/node_modules/.installed browser
test: $(SETUP)
	$(PYTEST)
	FDQ_TEST_ENGINE=fdb $(PYTEST)

test-sqlite: $(SETUP)
	$(PYTEST)

test-fdb: $(SETUP)
	FDQ_TEST_ENGINE=fdb $(PYTEST)

bench: $(VENV)/.installed
	$(PY) -m bench.engine
	$(PY) -m bench.queue_bench
