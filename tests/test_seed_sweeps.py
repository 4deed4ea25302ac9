"""tools/seed_sweeps.py, the sweeps behind the tolerances of the random-data tests,
still runs each test's own measurement: two seeds of every sweep (the live one on the
tests' adapter), each measured value's spread in its output."""

from __future__ import annotations

import json

import pytest

from script_helpers import run_script

NUMPY_SWEEPS = ["sharded-tq4-oracle", "estimator", "wrong-constant", "values", "turboquant-band", "tq4-cos",
                "gpu-slope"]  # fmt: skip


def _sweep(name: str, tmp_path) -> dict:
    out = tmp_path / f"{name}.json"
    r = run_script("tools/seed_sweeps.py", name, "--seeds", "2", "--first", "7", "--json-out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["sweep"] == name and doc["seeds"] == [7, 9]
    return doc


def _spreads(doc: dict) -> list[dict]:
    """Every spread in a sweep's output, however nested."""
    found = []
    for value in doc.values():
        if isinstance(value, dict):
            found += [value] if "n" in value and "max" in value else _spreads(value)
    return found


@pytest.mark.parametrize("name", NUMPY_SWEEPS)
def test_a_sweep_measures_its_test(name, tmp_path):
    spreads = _spreads(_sweep(name, tmp_path))
    assert spreads and all(s["n"] == 2 and s["min"] <= s["p50"] <= s["max"] for s in spreads), spreads


@pytest.mark.gpu
def test_the_live_sharded_sweep(engine, tmp_path):  # engine: an adapter is there
    doc = _sweep("sharded-tq4", tmp_path)
    assert doc["oracle norm_err"]["n"] == 2 and 0 < doc["oracle norm_err"]["max"] < 1, doc
    assert doc["twin rel_err"]["max"] < 1e-5, doc
