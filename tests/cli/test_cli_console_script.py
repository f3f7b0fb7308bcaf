"""End to end: the installed ``fdq`` console script in its own process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata, resources
from pathlib import Path

import pytest

import fdq

FDQ = Path(sys.executable).parent / "fdq"


@pytest.mark.slow
def test_installed_fdq_pushes_stdin_and_tails_it_back(tmp_path, url, sup):
    assert FDQ.exists(), f"no console script at {FDQ}: pip install -e . first"
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    env["FDQ_URL"] = url

    def fdq_cli(*args, input=None):
        return subprocess.run([str(FDQ), *args], input=input, capture_output=True, env=env,
                              cwd=tmp_path, timeout=120)

    lines = [f"message {i} caf\u00e9" for i in range(300)]
    pushed = fdq_cli("push", "orders", "-", "--key", "k", input="\n".join(lines).encode() + b"\n")
    assert pushed.returncode == 0, pushed.stderr
    ids = pushed.stdout.decode().split()
    assert len(ids) == len(set(ids)) == 300
    assert pushed.stderr.decode().strip().endswith("pushed 300 messages to 'orders'")

    tailed = fdq_cli("tail", "orders", "--count", "300", "--json", "--timeout", "30")
    assert tailed.returncode == 0, tailed.stderr
    got = [json.loads(line) for line in tailed.stdout.decode().splitlines()]
    assert [m["id"] for m in got] == ids                         # one shard key: push order
    assert [m["body"] for m in got] == lines

    st = sup.stats("orders")
    assert st["counters"]["inserted"] == 300
    assert (st["subscriptions"]["default"]["acked"], st["subscriptions"]["default"]["backlog"]) == (300, 0)
    assert fdq.Supervisor(sup.db).consumers("orders") == []       # the tail left

    missing = fdq_cli("stats", "nosuch")
    assert (missing.returncode, missing.stdout, missing.stderr) == \
        (1, b"", b"fdq: error: topic 'nosuch' does not exist\n")
    bad = fdq_cli("topics", "create", "x", "--shards", "zero")
    assert bad.returncode == 2 and b"'zero' is not an integer" in bad.stderr


def test_the_distribution_fdq_queue_provides_fdq_and_its_command():
    """The package index's ``fdq`` is an unrelated project (it ships an ``fdq/`` package
    too): FDQ's distribution is ``fdq-queue``, which provides ``import fdq``, the ``fdq``
    command and its ``--version``; every install line of the READMEs names it."""
    dist = metadata.distribution("fdq-queue")
    assert dist.version == fdq.__version__
    assert "fdq = fdq.cli:main" in {f"{e.name} = {e.value}" for e in dist.entry_points if e.group == "console_scripts"}
    out = subprocess.run([str(FDQ), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"fdq, version {fdq.__version__}", out
    root = Path(__file__).resolve().parents[2]
    for doc in (root / "README.md", root / "spark" / "README.md"):
        for what in re.findall(r"pip install\s+(\S+)", doc.read_text()):
            assert what == "-e" or "fdq-queue" in what, f"{doc}: pip install {what}"


def test_the_package_says_it_is_typed():
    """PEP 561: ``fdq/py.typed`` ships with the package (declared as package data), so
    type checkers read FDQ's annotations."""
    assert resources.files("fdq").joinpath("py.typed").is_file()
    setup = (Path(__file__).resolve().parents[2] / "setup.cfg").read_text()
    assert "fdq = py.typed" in setup
