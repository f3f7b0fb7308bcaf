"""bench/broker.py: FDQ's broker beside nsqd 1.3 in one run. Its quick run works against
FDQ alone, saying why nsqd was skipped (CI has no nsqd: it is built from source only where
Go and the source mirrors are, bench/nsqd.py); where an nsqd 1.3 is found, it runs beside
FDQ and the ratios come out; where it cannot be built, the reason names what is missing.

The bench always runs the broker on the embedded engine (sqlite://), whatever
FDQ_TEST_ENGINE says: engine-independent, so the sqlite pass runs it and the fdb pass skips."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import fdqtest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.xdist_group("broker_bench"),
              pytest.mark.skipif(fdqtest.ENGINE != "sqlite",
                                 reason="the bench runs the broker on the embedded engine (sqlite://) whatever the "
                                        "engine: the sqlite pass runs it")]

sys.path.insert(0, ROOT)
from bench import nsqd as nsqd_ref  # noqa: E402

CASES = ("pub1", "pub8", "mpub100", "consume", "latency")


def bench(*args, env=None, timeout=240):
    env = {k: v for k, v in (env or os.environ).items() if k != "FDQ_URL"}
    out = subprocess.run([sys.executable, "-m", "bench.broker", "--quick", "--json", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def positive(v):
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_quick_run_measures_fdq_alone_and_says_why_nsqd_was_skipped(tmp_path):
    report = bench("--nsqd", str(tmp_path / "no-nsqd"), "--dir", str(tmp_path), "--cases", ",".join(CASES))
    assert str(tmp_path / "no-nsqd") in report["skipped"]["nsqd"]
    assert report["meta"]["nsqd"] is None
    rows = {(r["case"], r["figure"]): r for r in report["rows"]}
    assert [c for c, _ in rows] == [*CASES[:4], "latency", "latency", "latency"]
    for row in rows.values():
        assert positive(row["fdq"]) and "nsqd" not in row and "fdq_over_nsqd" not in row, row
        assert row["target"]
    for case in CASES[:4]:
        assert positive(rows[(case, "msgs/s")]["fdq_cpu"])
    assert rows[("latency", "server CPU, cores")]["target"] == "fdq <= 0.35 core"
    runs = report["runs"]
    assert set(runs) == {f"fdq/{c}" for c in CASES}
    assert runs["fdq/pub8"][0]["clients"] == "8 processes"
    assert runs["fdq/consume"][0]["msgs"] == 12500               # the whole backlog, FIN each
    assert runs["fdq/latency"][0]["msgs"] == 1500                # 1.5 s at 1,000/s, every one received
    assert os.listdir(tmp_path) == []                            # each server's data directory removed


def test_nsqd_runs_beside_fdq_with_the_ratio(tmp_path):
    binary, why = nsqd_ref.find(build=False)
    if not binary:
        pytest.skip(f"no nsqd 1.3 here: {why} (python -m bench.nsqd builds one where Go and the mirrors are)")
    report = bench("--nsqd", binary, "--dir", str(tmp_path), "--cases", "pub1,latency")
    assert "v1.3" in report["meta"]["nsqd"] and report["skipped"] == {}
    rows = {(r["case"], r["figure"]): r for r in report["rows"]}
    for key in [("pub1", "msgs/s"), ("latency", "p50 ms"), ("latency", "server CPU, cores")]:
        row = rows[key]
        assert positive(row["nsqd"]) and positive(row["fdq"]), row
        assert row["fdq_over_nsqd"] == pytest.approx(row["fdq"] / row["nsqd"])
        assert row["met"] in ("yes", "no")
    assert report["runs"]["nsqd/latency"][0]["msgs"] == 1500


def test_nsqd_lookup_without_a_binary_names_what_a_build_lacks(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "FDQ_BENCH_MIRRORS": str(tmp_path / "mirrors"),
           "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if not os.path.exists(os.path.join(p, "nsqd")))}
    env.pop("FDQ_BENCH_NSQD", None)
    env.pop("FDQ_BENCH_GIT_BASE", None)
    out = subprocess.run([sys.executable, "-m", "bench.nsqd"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "cannot be built here" in out.stdout
    assert ("no `go` on PATH" in out.stdout or "Go libraries missing" in out.stdout
            or f"source mirrors missing under {tmp_path / 'mirrors'}: nsqio/nsq" in out.stdout), out.stdout
    assert not os.path.exists(tmp_path / "cache" / "fdq-bench" / "nsqd" / "bin" / "nsqd")


def test_nsqd_builds_from_the_pinned_sources_offline(tmp_path):
    why = nsqd_ref.missing_for_build()
    if why or os.environ.get("FDQ_BENCH_GIT_BASE"):
        pytest.skip(f"nsqd cannot be built offline here: {why or 'FDQ_BENCH_GIT_BASE set (would clone)'}")
    built = nsqd_ref.build_into(str(tmp_path / "nsqd"))
    assert built == str(tmp_path / "nsqd" / "bin" / "nsqd")
    assert nsqd_ref.version(built).startswith("nsqd v1.3.0")
    # go-svc under the path nsqd imports (GOPATH mode does not read go.mod's replace)
    assert os.path.isfile(tmp_path / "nsqd" / "gopath" / "src" / "github.com" / "judwhite" / "go-svc" / "svc.go")
