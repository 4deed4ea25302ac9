"""torch tensors in and out of the client, beside numpy arrays, and the dtypes
arrays travel and answers come back in.

Every array argument of the client (``q``, ``k``, ``v`` of every call) may be a
numpy array, anything ``numpy.asarray`` takes, or a ``torch.Tensor`` on any device
in any float dtype. It goes on the wire in its own dtype when the wire carries it
(float32, float16, bfloat16: nothing is converted) and as float32 otherwise
(float64, converted once; for a tensor on its own device). A tensor is copied to
the host once (a GPU tensor: ``.contiguous().cpu()``, no cast); a contiguous CPU
tensor of float32, float16 or bfloat16 is not copied at all (the wire encodes a
view of its memory; bfloat16 read as :data:`wire.BFLOAT16`).

An attend answers ``out`` in its ``out_dtype`` (:func:`out_dtype_name`), by
default the dtype its ``q`` went in. An attend whose ``q`` was a tensor answers a
tensor on ``q``'s device in ``q``'s dtype (or ``out_dtype``'s, when given), as
``torch.nn.functional.scaled_dot_product_attention`` does; otherwise a numpy array
in the answer's dtype: float32, float16, or bfloat16 as :data:`wire.BFLOAT16`
(two-byte void holding the bits; :func:`wire.to_float32` widens it exactly).
torch is never imported by the client: a tensor can only come from a program that
imported it (the optional extra ``attnserve-client[torch]`` installs it).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from . import wire

__all__ = ["Answer", "answer", "as_wire_array", "is_tensor", "out_dtype_name", "to_wire_dtype"]

#: What an attend answers: a numpy array in the answer's dtype, or a
#: ``torch.Tensor`` when its queries were one (typed loosely: the client never
#: imports torch).
Answer = Any

#: Other names ``out_dtype`` may be given by, for the wire's names.
_OUT_DTYPE_ALIASES = {"float32": "<f4", "float16": "<f2"}


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(a: Any) -> bool:
    """Whether ``a`` is a ``torch.Tensor`` (False whenever torch is not imported)."""
    torch = _torch()
    return torch is not None and isinstance(a, torch.Tensor)


def _torch_dtypes() -> dict[str, Any]:
    """The torch dtype of each wire dtype, by its wire name (torch is imported)."""
    torch = _torch()
    return {"<f4": torch.float32, "<f2": torch.float16, "bfloat16": torch.bfloat16}


def as_wire_array(a: Any, *, name: str = "array") -> np.ndarray:
    """``a`` as a C-contiguous numpy array of one of :data:`wire.DTYPES`, in its own
    dtype when the wire carries it and float32 otherwise (:func:`wire.as_wire_array`),
    a torch tensor included (see the module's docs).

    Raises:
        wire.WireError: not a float array or tensor.
    """
    if is_tensor(a):
        a = _host_array(a, name)
    return wire.as_wire_array(a, name=name)


def _host_array(tensor: Any, name: str) -> np.ndarray:
    """A numpy view of ``tensor`` on the host, in its dtype when the wire carries
    it (bfloat16 as :data:`wire.BFLOAT16`), else cast to float32 on its device."""
    torch = _torch()
    t = tensor.detach()
    if not t.is_floating_point():
        raise wire.WireError(f"{name}: expected a float tensor, got dtype {t.dtype}")
    if t.dtype not in _torch_dtypes().values():
        t = t.to(torch.float32)  # float64 and the like: once, on the tensor's device
    if t.device.type != "cpu":
        t = t.contiguous().cpu()
    bits = t.dtype == torch.bfloat16  # numpy has no bfloat16: its bits, as two-byte void
    host: np.ndarray = (t.view(torch.int16) if bits else t).numpy()  # a view of the CPU tensor's memory
    return host.view(wire.BFLOAT16) if bits else host


def host_view(tensor: Any) -> np.ndarray:
    """A writable numpy view of a contiguous CPU tensor of a wire dtype (bfloat16
    as :data:`wire.BFLOAT16`): writing to it writes the tensor."""
    torch = _torch()
    bits = tensor.dtype == torch.bfloat16
    host: np.ndarray = (tensor.view(torch.int16) if bits else tensor).numpy()
    return host.view(wire.BFLOAT16) if bits else host


def out_dtype_name(dtype: Any) -> str | None:
    """The wire name (a key of :data:`wire.DTYPES`) of an attend's ``out_dtype``,
    or None for none (the answer comes in ``q``'s dtype).

    ``dtype`` may be a wire name (``"<f4"``, ``"<f2"``, ``"bfloat16"``),
    ``"float32"`` or ``"float16"``, a numpy dtype (or scalar type) of float32 or
    float16 or :data:`wire.BFLOAT16`, or a torch dtype (``torch.float32``,
    ``torch.float16``, ``torch.bfloat16``).

    Raises:
        wire.WireError: any other value (float64 too: the wire does not carry it).
    """
    if dtype is None:
        return None
    name: str | None
    if isinstance(dtype, str):
        name = _OUT_DTYPE_ALIASES.get(dtype, dtype)
    elif _torch() is not None and isinstance(dtype, _torch().dtype):
        name = next((n for n, t in _torch_dtypes().items() if t == dtype), None)
    else:
        try:
            as_numpy = np.dtype(dtype)
        except (TypeError, ValueError):
            as_numpy = None
        name = next((n for n, dt in wire.DTYPES.items() if dt == as_numpy), None)
    if name not in wire.DTYPES:
        raise wire.WireError(
            f"out_dtype: expected one of {sorted(wire.DTYPES)} (float32, float16, bfloat16), "
            f"a numpy or torch dtype of those, or None, got {dtype!r:.60}"
        )
    return name


def to_wire_dtype(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 array in the wire dtype ``dtype`` (a key of :data:`wire.DTYPES`),
    rounded to nearest even: float16 by numpy (past its range: infinite), bfloat16
    by :func:`wire.to_bfloat16`; float32 as it is."""
    if dtype == "bfloat16":
        return wire.to_bfloat16(arr)
    with np.errstate(over="ignore"):
        return arr.astype(wire.DTYPES[dtype], copy=False)


def answer(out: np.ndarray, like: Any, out_dtype: str | None = None) -> Answer:
    """An attend's output ``out`` (as it came: float32, float16, or bfloat16 as
    :data:`wire.BFLOAT16`) as the caller gave its queries ``like``: when ``like`` is
    a tensor, a tensor on ``like``'s device in ``like``'s dtype, or in ``out_dtype``
    (a wire name) when the caller asked for one; else ``out`` as it came (a bfloat16
    answer stays :data:`wire.BFLOAT16`, which :func:`wire.to_float32` widens)."""
    if not is_tensor(like):
        return out
    torch = _torch()
    dtypes = _torch_dtypes()
    held = dtypes[wire.dtype_name(out)]
    dtype = like.dtype if out_dtype is None else dtypes[out_dtype]
    if like.device.type == "cpu" and dtype == held and not out.flags.writeable:
        # the tensor is the answer itself (``to`` below keeps it) and owns what it
        # holds: the answer's bytes are read-only when they are the received message's
        out = out.copy()
    with warnings.catch_warnings():
        # read-only bytes are only read here: cast or copied to the device at once
        warnings.simplefilter("ignore", UserWarning)
        host = torch.from_numpy(out.view(np.int16) if held == torch.bfloat16 else out)
    if held == torch.bfloat16:
        host = host.view(torch.bfloat16)  # the bits as they came, no float32 round trip
    return host.to(device=like.device, dtype=dtype)
