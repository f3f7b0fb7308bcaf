"""The README's Python examples run as written (its ``python`` blocks, each in a process
of its own on a fresh embedded database through ``FDQ_URL``). The Spark ones (the
README's and spark/README.md's) run in tests/spark/test_spark_readme_examples.py; the command
line ones in tests/cli/test_cli_readme.py. Blocks that install or run the whole suite
(``pip install``, ``make test``) are not run here."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks(path: pathlib.Path) -> list:
    """The ``python`` fenced blocks of a Markdown file, in order."""
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), re.S | re.M)


def _is_spark(block: str) -> bool:
    return "spark" in block


BLOCKS = [b for b in python_blocks(ROOT / "README.md") if not _is_spark(b)]


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2 and any("fdq.tail" in b for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.strip().splitlines()[0][:40])
def test_a_readme_python_example_runs_as_written(block, tmp_path, db_url):
    env = {**os.environ, "FDQ_URL": db_url}
    r = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
