"""The tree is lint-clean and formatted (ruff), and the client package, which ships
py.typed, and the server package pass mypy --strict: the configuration is in
pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not installed: it is in the project's [test] extra")
    return [exe]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check():
    r = _run([*_tool("ruff"), "check", "."])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_format():
    r = _run([*_tool("ruff"), "format", "--check", "."])
    assert r.returncode == 0, "not formatted (ruff format .):\n" + r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_client_strict():
    r = _run([*_tool("mypy")])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Success" in r.stdout


def test_mypy_service_strict():
    # the same configuration (strict; wgpu, untyped, is Any), on the server package
    r = _run([*_tool("mypy"), "service/attnserve"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Success" in r.stdout
