"""Secrets never appear in a tool's help or report: every command-line tool of the
repository (the server's CLI, loadtest, soak, bench, examples) is run with
``--help`` while the API-key variables hold a planted key, and its output must not
contain the key. The load test's report of its configuration is checked too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANTED = "planted-Secret-7f3a9c"

# Every Python tool a user runs from a checkout (a script with a __main__ guard, not
# the modules it imports).
TOOLS = sorted(
    str(p.relative_to(ROOT))
    for folder in ("loadtest", "soak", "bench", "bench/probes", "examples")
    for p in (ROOT / folder).glob("*.py")
    if '__name__ == "__main__"' in p.read_text()
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        ATTNSERVE_API_KEY=PLANTED,
        ATTNSERVE_API_KEYS=f"{PLANTED},other-{PLANTED}",
        PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), env.get("PYTHONPATH", "")]),
        XDG_RUNTIME_DIR=env.get("XDG_RUNTIME_DIR", "/tmp"),
    )
    return env


def test_every_tool_is_found():
    # the list above is not empty by accident (a renamed folder)
    assert {"loadtest/loadtest.py", "soak/soak.py", "bench/service.py", "examples/decode_loop.py"} <= set(TOOLS)


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help_hides_planted_key(tool):
    r = subprocess.run(
        [sys.executable, tool, "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower()
    assert PLANTED not in r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["adapters", "--help"]])
def test_server_cli_help_hides_planted_key(argv):
    r = subprocess.run(
        [sys.executable, "-m", "attnserve", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert PLANTED not in r.stdout + r.stderr


def test_loadtest_takes_key_from_env_but_never_reports_it(monkeypatch):
    from loadtest import loadtest

    monkeypatch.setenv("ATTNSERVE_API_KEY", PLANTED)
    cfg = loadtest.parse_args(["--duration", "1"])
    assert cfg.api_key == PLANTED  # the variable still supplies the key
    assert PLANTED not in repr(cfg) and PLANTED not in str(cfg.public())
    cfg = loadtest.parse_args(["--api-key", "given-on-the-command-line"])
    assert cfg.api_key == "given-on-the-command-line"
