"""The one compiled part of attnserve: the GPU thread's command recording
(service/attnserve/gpu/_commands.c; docs/benchmarks.md, issue 43 item 6), built by
pip with the machine's C compiler. Everything else is in pyproject.toml.

The module carries its source's SHA-256 (``_commands.SOURCE_DIGEST``): a checkout
whose ``_commands.c`` changed after the build refuses the stale module
(attnserve/gpu/native.py), and the image check compares it with the checkout's
(deploy/image/image_matches_checkout.py)."""

import hashlib
import os
import shlex
import shutil
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = "service/attnserve/gpu/_commands.c"
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()


def missing_toolchain() -> list[str]:
    """What the build of the C module lacks: the C compiler it would run (``CC``,
    else the one Python was built with) and Python's headers (``Python.h``)."""
    missing = []
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[:1]
    if not cc or shutil.which(cc[0]) is None:
        missing.append(f"a C compiler ({cc[0] if cc else 'CC'} is not on PATH)")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        missing.append(f"Python's headers ({headers} does not exist)")
    return missing


class checked_build_ext(build_ext):
    """build_ext that says first, in one line, what the machine lacks to build the
    module, instead of the compiler call's error at the end of the build's log."""

    def run(self) -> None:
        missing = missing_toolchain()
        if missing:
            raise SystemExit(
                f"attnserve: cannot build its C module ({SOURCE}), this machine lacks {' and '.join(missing)}: "
                "install them (Debian: apt-get install gcc python3-dev; ./dev.sh does it) and run pip again"
            )
        super().run()


setup(
    cmdclass={"build_ext": checked_build_ext},
    ext_modules=[
        Extension(
            "attnserve.gpu._commands",
            sources=[SOURCE],
            define_macros=[("SOURCE_DIGEST", f'"{DIGEST}"')],
            extra_compile_args=["-std=c11"],
            libraries=["dl"],
        )
    ],
)
