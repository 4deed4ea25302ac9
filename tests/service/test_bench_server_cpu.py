"""bench/server_cpu.py in its short form (what CI runs): the server's CPU time per
small request, read from the server process's own counters. Numbers are reported,
never asserted against a speed (benchmarks measure; tests check that they run)."""

from __future__ import annotations

import json

import pytest

from script_helpers import run_script


@pytest.mark.gpu
def test_server_cpu_quick_reports_every_kind(engine, tmp_path):
    out = tmp_path / "cpu.json"
    r = run_script("bench/server_cpu.py", "--quick", "--json-out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "adapter"}, indent=1))
    for kind in ("get_session", "attend_tiny", "attend_tiny_stream"):
        m = report[kind]
        assert m["requests"] == 200
        assert m["cpu_ms_per_request"] > 0 and m["wall_ms_per_request"] > 0
