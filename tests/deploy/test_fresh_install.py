"""The README's installs work in a fresh virtual environment, with no dev.sh: ``pip
install .`` from a copy of the checkout gives the server (the ``attnserve`` command),
the load test (``attnserve-loadtest``) and the client package, and ``pip install ./client`` gives the client alone.

pip resolves the dependencies as a user's would (the machine's index configuration,
its cache); nothing of this checkout's .venv is used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def copy_checkout(dest: Path) -> Path:
    """The files of the working tree git does not ignore (no .venv, no build/)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin"


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def license_expression(bin_: Path, distribution: str, cwd: Path) -> str:
    code = f"import importlib.metadata as m; print(m.metadata({distribution!r})['License-Expression'])"
    return run([str(bin_ / "python"), "-c", code], cwd=cwd).stdout.strip()


@pytest.mark.skipif(sys.platform == "win32", reason="venv's bin/ layout")
def test_pip_install_dot_gives_the_server_and_the_client(tmp_path):
    checkout = copy_checkout(tmp_path / "checkout")
    bin_ = fresh_venv(tmp_path / "venv")
    run([str(bin_ / "python"), "-m", "pip", "install", "-q", "."], cwd=checkout)
    usage = run([str(bin_ / "attnserve"), "--help"], cwd=tmp_path).stdout
    assert "serve" in usage
    assert "--port" in run([str(bin_ / "attnserve"), "serve", "--help"], cwd=tmp_path).stdout
    # the load test, installed as a command of its own
    assert "--warmup-s" in run([str(bin_ / "attnserve-loadtest"), "--help"], cwd=tmp_path).stdout
    # imported from the venv, not from the copy of the checkout
    where = run(
        [str(bin_ / "python"), "-c", "import attnserve.app, attnserve_client; print(attnserve_client.__file__)"],
        cwd=tmp_path,
    ).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), where
    assert license_expression(bin_, "attnserve", tmp_path) == "Apache-2.0"


@pytest.mark.skipif(sys.platform == "win32", reason="venv's bin/ layout")
def test_pip_install_client_alone(tmp_path):
    checkout = copy_checkout(tmp_path / "checkout")
    bin_ = fresh_venv(tmp_path / "venv")
    run([str(bin_ / "python"), "-m", "pip", "install", "-q", "./client"], cwd=checkout)
    code = (
        "import importlib.util, attnserve_client\n"
        "from attnserve_client import AsyncClient, Client\n"
        "assert importlib.util.find_spec('attnserve') is None, 'the server came with the client'\n"
        "print(attnserve_client.__file__)\n"
    )
    where = run([str(bin_ / "python"), "-c", code], cwd=tmp_path).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), where
    assert license_expression(bin_, "attnserve-client", tmp_path) == "Apache-2.0"


@pytest.mark.parametrize("cc", ["/nonexistent/gcc", "no-such-compiler -pthread"])
def test_a_build_without_a_compiler_says_so_in_one_line(tmp_path, cc):
    """Without the C compiler the build would run, setup.py stops before the build
    with one line naming what is missing and how to install it (not the compiler
    call's error at the end of the build's log). It fails before compiling, but the
    module's other tests install, so it is slow with them."""
    src = copy_checkout(tmp_path / "src")
    env = {**os.environ, "CC": cc}
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "t")],
        cwd=src, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("attnserve: cannot build its C module")]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"lacks a C compiler ({cc.split()[0]} is not on PATH)" in lines[0] and "apt-get install gcc" in lines[0]
