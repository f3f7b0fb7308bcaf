"""The Spark examples run as written: spark/README.md's Python blocks in order (session,
batch read, streaming read, write), then the README's, in this directory's Spark session
on a database given by ``FDQ_URL`` (the README's own test, tests/test_readme_examples.py,
runs its other blocks)."""
from __future__ import annotations

import glob
import os
import pathlib
import re

import pyarrow.parquet as pq
import pytest

import fdq
from fdqtest import database_url

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _python_blocks(path: pathlib.Path) -> list:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), re.S | re.M)


@pytest.fixture
def orders(tmp_path, monkeypatch):
    """An "orders" topic with headers (kind) and shard keys, FDQ_URL naming its database,
    the working directory a fresh one (the examples write out/ and ck/ there)."""
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    fdq.Supervisor(db).create_topic("orders", extend=True, shards=4)
    fdq.Producer(db).push_many("orders", [
        fdq.Envelope(f"m{i}".encode(), shard_key="cust-42" if i % 2 else f"cust-{i}",
                     headers={"kind": "refund" if i % 3 else "sale"}) for i in range(30)])
    monkeypatch.setenv("FDQ_URL", url)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return db


def test_the_spark_readme_runs_as_written(spark, orders, capsys):
    blocks = _python_blocks(ROOT / "spark" / "README.md")
    assert len(blocks) == 4
    ns = {}
    for block in blocks:
        exec(compile(block, "spark/README.md", "exec"), ns)
    assert ns["df"].count() == 30
    out = capsys.readouterr().out
    assert "refund" in out and "sale" in out            # the groupBy by a header's value
    files = glob.glob(os.path.join("out", "*.parquet"))
    assert sum(pq.read_table(f).num_rows for f in files) == 30     # the stream, once each
    copied = fdq.Supervisor(orders).stats("orders-copy")["counters"]["inserted"]
    assert copied == 30


def test_the_readme_spark_example_runs_as_written(spark, orders):
    [block] = [b for b in _python_blocks(ROOT / "README.md") if "spark" in b]
    ns = {"spark": spark}
    exec(compile(block, "README.md", "exec"), ns)
    assert ns["df"].count() == 30
