"""The one compiled part of attnserve: the GPU thread's command recording
(service/attnserve/gpu/_commands.c; docs/benchmarks.md, issue 43 item 6), built by
pip with the machine's C compiler. Everything else is in pyproject.toml.

The module carries its source's SHA-256 (``_commands.SOURCE_DIGEST``): a checkout
whose ``_commands.c`` changed after the build refuses the stale module
(attnserve/gpu/native.py), and the image check compares it with the checkout's
(deploy/image/image_matches_checkout.py)."""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "service/attnserve/gpu/_commands.c"
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "attnserve.gpu._commands",
            sources=[SOURCE],
            define_macros=[("SOURCE_DIGEST", f'"{DIGEST}"')],
            extra_compile_args=["-std=c11"],
            libraries=["dl"],
        )
    ]
)
