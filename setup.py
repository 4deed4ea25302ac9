"""The compiled parts of attnserve, built by pip with the machine's C compiler:
the GPU thread's command recording (service/attnserve/gpu/_commands.c;
docs/benchmarks.md, issue 43 item 6) and the layer-call frame's parser and step
checks (service/attnserve/plane/callframe.c and its binding _callframe.c;
docs/architecture.md, issue 53). Everything else is in pyproject.toml.

Each module carries its sources' SHA-256 (``SOURCE_DIGEST``; ``_callframe`` also
``SOURCES``, one digest per file): a checkout whose source changed after the build
refuses the stale module (attnserve/gpu/native.py; tests/test_callframe.py), and
the image check compares them with the checkout's
(deploy/image/image_matches_checkout.py)."""

import hashlib
import os
import shlex
import shutil
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
SOURCE = "service/attnserve/gpu/_commands.c"
DIGEST = hashlib.sha256((HERE / SOURCE).read_bytes()).hexdigest()

# the call frame: the pure C core (callframe.h, callframe.c) and its binding
CALLFRAME = "service/attnserve/plane"
CALLFRAME_FILES = {
    "SOURCE_CALLFRAME_H": "callframe.h",
    "SOURCE_CALLFRAME_C": "callframe.c",
    "SOURCE_BINDING_C": "_callframe.c",
}
CALLFRAME_DIGESTS = {
    macro: hashlib.sha256((HERE / CALLFRAME / name).read_bytes()).hexdigest() for macro, name in CALLFRAME_FILES.items()
}
# the module's own digest: of the three files' digests, in this order
CALLFRAME_DIGEST = hashlib.sha256("".join(CALLFRAME_DIGESTS.values()).encode()).hexdigest()


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
                f"attnserve: cannot build its C modules ({SOURCE}, {CALLFRAME}/_callframe.c), "
                f"this machine lacks {' and '.join(missing)}: "
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
        ),
        Extension(
            "attnserve.plane._callframe",
            sources=[f"{CALLFRAME}/_callframe.c", f"{CALLFRAME}/callframe.c"],
            depends=[f"{CALLFRAME}/callframe.h"],
            define_macros=[
                ("SOURCE_DIGEST", f'"{CALLFRAME_DIGEST}"'),
                *((macro, f'"{digest}"') for macro, digest in CALLFRAME_DIGESTS.items()),
            ],
            extra_compile_args=["-std=c11"],
        ),
    ],
)
