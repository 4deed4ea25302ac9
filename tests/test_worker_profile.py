"""bench/worker_profile.py runs as the device probe runs it (stacked, plans counted):
a bench script the H200 probes call must not break unnoticed."""

from __future__ import annotations

import json

import pytest
from script_helpers import run_script

pytestmark = pytest.mark.gpu


def test_worker_profile_times_a_stacked_step_and_counts_its_plans(engine, tmp_path):  # engine: an adapter is there
    out = tmp_path / "worker.json"
    r = run_script(
        "bench/worker_profile.py",
        "--sessions",
        "3",
        "--context",
        "40",
        "--stacked",
        "--steps",
        "4",
        "--formats",
        "f32",
        "--layers",
        "2",
        "--top",
        "0",
        "--json-out",
        str(out),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["items"] for r in rows] == [1, 3]  # one session, then all
    for row in rows:
        assert row["stacked"] and row["layers"] == 2 and row["steps"] == 4
        assert row["step_plans"]["made"] >= 1 and row["step_plans"]["run"] >= 1 and row["step_plans"]["missed"] == 0
        assert row["plan_ms"] > 0 and row["submit_readback_ms"] > 0
