"""torch tensors in and out of the client, beside numpy arrays.

Every array argument of the client (``q``, ``k``, ``v`` of every call) may be a
numpy array, anything ``numpy.asarray`` takes, or a ``torch.Tensor`` on any device
in any float dtype (float32, float16, bfloat16, float64). A tensor is converted
once: cast to float32 and made contiguous on its own device (a GPU does it
there), then copied to the host; a contiguous float32 CPU tensor is not copied at
all (the wire encodes a view of its memory).

An attend whose ``q`` was a tensor answers a tensor on ``q``'s device in ``q``'s
dtype, as ``torch.nn.functional.scaled_dot_product_attention`` does; otherwise it
answers a float32 numpy array. torch is never imported by the client: a tensor can
only come from a program that imported it (the optional extra
``attnserve-client[torch]`` installs it).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from . import wire

__all__ = ["Answer", "answer", "as_float32", "is_tensor"]

#: What an attend answers: a float32 numpy array, or a ``torch.Tensor`` when its
#: queries were one (typed loosely: the client never imports torch).
Answer = Any


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(a: Any) -> bool:
    """Whether ``a`` is a ``torch.Tensor`` (False whenever torch is not imported)."""
    torch = _torch()
    return torch is not None and isinstance(a, torch.Tensor)


def as_float32(a: Any, *, name: str = "array") -> np.ndarray:
    """``a`` as a C-contiguous little-endian float32 numpy array (``wire.as_float32``),
    a torch tensor included (see the module's docs).

    Raises:
        wire.WireError: not a float array or tensor.
    """
    if is_tensor(a):
        torch = _torch()
        t = a.detach()
        if not t.is_floating_point():
            raise wire.WireError(f"{name}: expected a float tensor, got dtype {t.dtype}")
        if t.dtype != torch.float32:
            t = t.to(torch.float32)
        if t.device.type != "cpu":
            t = t.contiguous().cpu()
        a = t.numpy()  # a view of the CPU tensor's memory
    return wire.as_float32(a, name=name)


def answer(out: np.ndarray, like: Any) -> Answer:
    """An attend's output ``out`` as the caller gave its queries ``like``: a tensor
    on ``like``'s device in ``like``'s dtype when it is a tensor, else ``out``."""
    if not is_tensor(like):
        return out
    torch = _torch()
    if like.device.type == "cpu" and like.dtype == torch.float32:
        # the tensor owns what it holds: the answer's bytes are read-only when they
        # are the received message's
        return torch.from_numpy(out if out.flags.writeable else out.copy())
    with warnings.catch_warnings():
        # read-only bytes are only read here: cast or copied to the device at once
        warnings.simplefilter("ignore", UserWarning)
        host = torch.from_numpy(out)
    return host.to(device=like.device, dtype=like.dtype)
