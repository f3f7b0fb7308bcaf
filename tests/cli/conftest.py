"""Fixtures of the CLI tests: a way to run ``fdq`` on the test's database (``url``, from
tests/conftest.py) through click's CliRunner (stdout and stderr kept apart), and a
snapshot of everything stored."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fdq.cli import cli
from fdqtest import wait_for


class Fdq:
    """``fdq(*args, input=..., code=0)`` runs ``fdq --url URL *args`` and checks the
    exit code; ``.json(*args)`` also parses stdout."""

    def __init__(self, url):
        self.url = url
        self.runner = CliRunner()

    def __call__(self, *args, input=None, code=0, env=None):
        result = self.runner.invoke(cli, ["--url", self.url, *map(str, args)], input=input, env=env,
                                    catch_exceptions=False)
        assert result.exit_code == code, (
            f"fdq {' '.join(map(str, args))}: exit {result.exit_code}, expected {code}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}")
        return result

    def usage_error(self, argv, text, input=None):
        """``fdq *argv`` refused as a usage error: exit 2, nothing on stdout, one
        ``Error:`` line on stderr that holds ``text``."""
        r = self(*argv, code=2, input=input)
        assert r.stdout == ""
        error_lines = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
        assert len(error_lines) == 1 and text in error_lines[0], r.stderr
        return r

    def json(self, *args, **kwargs):
        return json.loads(self(*args, "--json", **kwargs).stdout)

    def json_lines(self, *args, **kwargs):
        return [json.loads(line) for line in self(*args, "--json", **kwargs).stdout.splitlines()]


@pytest.fixture
def run(url):
    return Fdq(url)


@pytest.fixture
def wait():
    return wait_for


@pytest.fixture
def state(db, sup):
    """``state()``: everything stored, to compare before and after a bad command."""
    return lambda: state_of(db, sup)


def state_of(db, sup) -> dict:
    """Everything stored about every topic, as the Python API reports it, plus the raw
    key space: what a bad command must leave untouched."""
    snapshot = {"topics": [(n, c.as_dict()) for n, c in sup.topics()]}
    for name, _c in sup.topics():
        st = sup.stats(name)
        st["maintenance"].pop("last_pass_age_s")    # versions pass
        for s in st["subscriptions"].values():
            s.pop("lag_ms")        # wall-clock dependent
            for c in s["consumers"]:
                c.pop("heartbeat_age_s")
        snapshot[name] = st
    tr = db.create_transaction()
    snapshot["keys"] = [(bytes(kv.key), bytes(kv.value)) for kv in tr.get_range(b"", b"\xff")]
    tr.cancel()
    return snapshot
