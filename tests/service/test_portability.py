"""The server imports where ``fcntl`` does not exist (Windows): the snapshot
directory's lock falls back to ``msvcrt.locking``. Run in a fresh interpreter with
``fcntl`` hidden and a stand-in ``msvcrt`` that records the lock."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import asyncio, errno, os, subprocess, sys, types  # stdlib modules that probe msvcrt for Windows: first

    sys.modules["fcntl"] = None  # import fcntl raises ImportError, as on Windows
    held = set()

    def locking(fd, mode, nbytes):
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        assert mode == msvcrt.LK_NBLCK and nbytes == 1
        if key in held:
            raise OSError(errno.EDEADLK, "Resource deadlock avoided")
        held.add(key)

    msvcrt = types.ModuleType("msvcrt")
    msvcrt.LK_NBLCK = 2
    msvcrt.locking = locking
    sys.modules["msvcrt"] = msvcrt

    import attnserve.app  # the whole server
    from attnserve.persistence import SnapshotDir

    SnapshotDir(sys.argv[1], None).open()
    try:
        SnapshotDir(sys.argv[1], None).open()
    except RuntimeError as e:
        print("second:", e)
    print("locks:", len(held))
""")


def test_the_server_imports_and_locks_without_fcntl(tmp_path):
    env = {"PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'client'}", "XDG_RUNTIME_DIR": "/tmp", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "snaps")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "second: snapshot_dir" in r.stdout and "is in use by another server" in r.stdout
    assert "locks: 1" in r.stdout
