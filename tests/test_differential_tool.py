"""tools/differential.py, the check that a refactor of the step path changes no
answer: two servers of one tree agree on its whole mix; a tree whose one problem
detail differs is caught, with the request that showed it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from script_helpers import ROOT, run_script

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _run(old: Path, new: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    args = ("--old", str(old), "--new", str(new), "--ops", "60", "--seed", "5", "--logs", str(tmp_path))
    return run_script("tools/differential.py", *args, timeout=500)


def _tree(tmp_path: Path, name: str) -> Path:
    tree = tmp_path / name
    for part in ("service", "client", "tools", "loadtest", "shaders"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def test_one_tree_agrees_with_itself_over_every_form(tmp_path):
    r = _run(ROOT, ROOT, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["differences"] == 0 and all(
        doc["compared"][form] > 0 for form in ("route", "items", "stacked", "stream")
    )
    assert doc["outcomes"]["answered"] > 0 and len(doc["outcomes"]) > 2  # answers and several kinds of problem


def test_a_changed_problem_detail_is_found(tmp_path):
    changed = _tree(tmp_path, "changed")
    store = changed / "service/attnserve/store.py"
    text = store.read_text()
    assert "is not the layer's length" in text
    store.write_text(text.replace("is not the layer's length", "is not the layer length"))
    r = _run(ROOT, changed, tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "DIFFERENT" in r.stderr and "is not the layer length" in r.stderr
