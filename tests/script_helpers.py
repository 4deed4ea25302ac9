"""Running the repository's scripts (benchmarks, probes, tools) as a user does: this
Python, from the repository root, in the tests' environment (conftest.py sets what
the scripts need, such as XDG_RUNTIME_DIR)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(path: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python PATH ARGS...`` (``path`` from the repository root), its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / path), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
