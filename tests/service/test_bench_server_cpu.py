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


@pytest.mark.gpu
def test_server_cpu_steps_reports_every_form_and_thread(engine, tmp_path):
    """``--steps``, tiny: every form at two item counts, the threads named, a fit each."""
    out = tmp_path / "steps.json"
    r = run_script(
        "bench/server_cpu.py", "--steps", "--items", "1,2", "--calls", "3", "--repeats", "1",
        "--json-out", str(out), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    forms = ("stacked-frames", "step-doc-frames", "step-callframe", "step-doc-shm", "step-doc-stream")
    assert report["mode"] == "steps" and "attnserve-gpu" in report["server_threads"]
    assert sorted((c["form"], c["items"]) for c in report["cells"]) == sorted((f, b) for f in forms for b in (1, 2))
    for cell in report["cells"]:
        assert cell["calls"] == 3
        assert cell["cpu_us_per_call"]["event_loop"] > 0 and cell["cpu_us_per_call"]["gpu_thread"] > 0
    for form in forms:
        for group in ("event_loop", "gpu_thread", "server_host", "process"):
            f = report["fits"][form][group]
            assert len(f["repeats"]) == 1 and f["fixed_us_spread"][0] <= f["fixed_us"] <= f["fixed_us_spread"][1]
