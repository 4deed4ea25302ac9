"""A batch's uploads, commands and submission in one compiled call.

The GPU thread's hot loop: :meth:`attnserve.gpu.batch.Batch.encode` writes a
batch's uploads, records its dispatches and copies, and submits them. Made through
wgpu-py, each is a Python call into wgpu-native (its checks, its error capture, a
cffi call that releases and takes back the GIL): about 17 for one fused decode
step, most of a small step's encode time, and each a wait for the GIL again
beside a busy event loop (docs/benchmarks.md). Here the batch hands them over as
one program to ``_commands.c``, compiled by pip with the machine's C compiler,
which makes the wgpu-native calls with the GIL released once.

It calls the wgpu-native library that wgpu-py loaded, on the handles of wgpu-py's
objects (which keep owning them), with the C signatures of wgpu-native 29
(``wgpu`` 0.32, pinned in pyproject.toml). A validation error is captured around
the call as wgpu-py captures it around its own calls, and raised the same way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import wgpu
from wgpu.backends.wgpu_native import GPUCommandBuffer, ffi, lib_path
from wgpu.backends.wgpu_native._api import error_handler
from wgpu.backends.wgpu_native._helpers import ERROR_TYPES

_BUILD = "pip install -e . (a checkout), or python setup.py build_ext --inplace"
try:
    from . import _commands
except ImportError as e:  # pragma: no cover - a checkout that was never built
    raise ImportError(f"attnserve.gpu._commands is not built ({e}): {_BUILD}") from e


def _check_build(source: Path) -> None:
    """In a checkout (the source beside the module), refuse a module built from
    another version of it: an edit of _commands.c is not picked up until rebuilt."""
    built_from = getattr(_commands, "SOURCE_DIGEST", None)
    if source.is_file() and hashlib.sha256(source.read_bytes()).hexdigest() != built_from:
        raise ImportError(f"attnserve.gpu._commands was built from an older {source.name}: {_BUILD}")


_check_build(Path(__file__).with_name("_commands.c"))

__all__ = ["OP_COPY", "OP_DISPATCH", "OP_WORDS", "Writes", "handle", "run"]

OP_DISPATCH: int = _commands.OP_DISPATCH
OP_COPY: int = _commands.OP_COPY
OP_WORDS: int = _commands.OP_WORDS

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

_CAPTURE = "attnserve.gpu.native"

# (buffer handle, offset, bytes): one queue.write_buffer each
Writes = list[tuple[int, int, object]]

_commands.bind(lib_path)


def handle(obj: object) -> int:
    """The wgpu-native handle of a wgpu-py object (a device, queue, buffer,
    pipeline, bind group, query set), as an integer. The object keeps owning it."""
    return int(ffi.cast("uintptr_t", obj._internal))  # type: ignore[attr-defined]


def run(
    device: wgpu.GPUDevice,
    writes: Writes,
    program: "Buffer",
    query_set: wgpu.GPUQuerySet | None = None,
    submit: bool = True,
) -> wgpu.GPUCommandBuffer | None:
    """Write ``writes`` through ``device``'s queue, record ``program`` (``OP_WORDS``
    uint64 words per command: ``OP_DISPATCH, pipeline, bind group, x, y, z`` or
    ``OP_COPY, source, offset, destination, offset, size``) into one command buffer,
    and submit it (None) or return it (``submit=False``: the caller submits it).
    With ``query_set``, each dispatch is a compute pass of its own, timed at
    queries 2i and 2i + 1. Raises wgpu's error if wgpu-native reported one (and
    submits nothing then)."""
    queue = handle(device.queue)
    error_handler.capture(_CAPTURE)
    try:
        commands = _commands.record(
            handle(device), queue, writes, program, handle(query_set) if query_set is not None else 0
        )
    finally:
        error = error_handler.release(_CAPTURE)
    if error is not None:  # never submitted: wgpu-native's submit aborts on an invalid command buffer
        _commands.release(commands)
        _raise(error)
    if not submit:
        return GPUCommandBuffer("", ffi.cast("WGPUCommandBuffer", commands), device)
    error_handler.capture(_CAPTURE)
    try:
        _commands.submit(queue, commands)
    finally:
        error = error_handler.release(_CAPTURE)
    if error is not None:
        _raise(error)
    return None


def _raise(error: tuple[str, str]) -> NoReturn:
    """Raise what wgpu-native reported as wgpu-py raises it around its own calls."""
    kind, message = error
    raise ERROR_TYPES.get(kind, wgpu.GPUError)(message)
