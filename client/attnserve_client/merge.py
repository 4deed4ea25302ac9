"""Partial attention and its log-sum-exp: :class:`Attention` and :func:`merge`.

An attend sent with ``return_lse=True`` answers, beside ``out [n, H, d]``, the
log-sum-exp of each query row's scaled scores over the keys it attended,
``lse [n, H]`` (natural log). Two attends of the same queries over disjoint sets
of keys (two sessions holding different timesteps, a session here and an exact
recent window on the engine's own GPU) combine exactly into attention over the
union of the keys:

    M = max_j lse_j;  w_j = exp(lse_j - M);  out = sum_j w_j out_j / sum_j w_j;
    lse = M + log(sum_j w_j)

A part whose ``lse`` is ``-inf`` (no key) weighs nothing; when no part has a key
the merge is ``out = 0``, ``lse = -inf``. :func:`merge` takes numpy arrays of
any float dtype, bfloat16 (``wire.BFLOAT16``) included (computed in float64), or
torch tensors (computed on their device in float32, or
float64 when given float64), as the FlashInfer ``merge_state`` family does.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from . import tensors, wire

__all__ = ["Attention", "merge"]


class Attention(NamedTuple):
    """An attend's answer with ``return_lse=True``: ``out [..., H, d]`` and
    ``lse [..., H]`` (natural log of the sum of exp of the scaled scores), numpy
    arrays or torch tensors as the attend's ``q`` was."""

    out: Any
    lse: Any


def merge(parts: Sequence[Attention | tuple[Any, Any]]) -> Attention:
    """Attention over the union of the keys of ``parts``, from each part's
    ``(out [..., H, d], lse [..., H])`` over its own keys (disjoint sets of keys of
    the same queries). numpy in, float32 numpy out (computed in float64); torch in,
    a tensor out on the first part's device in its dtype.

    Raises:
        ValueError: no part, or parts whose shapes disagree.
    """
    if not parts:
        raise ValueError("merge: expected at least one (out, lse) part")
    pairs = [tuple(p) for p in parts]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("merge: every part is an (out, lse) pair")
    out0, lse0 = pairs[0]
    shape = tuple(out0.shape)
    for out, lse in pairs:
        if tuple(out.shape) != shape or tuple(lse.shape) != shape[:-1]:
            raise ValueError(
                f"merge: every part needs out of shape {shape} and lse of shape {shape[:-1]}, "
                f"got {tuple(out.shape)} and {tuple(lse.shape)}"
            )
    if tensors.is_tensor(out0):
        return _merge_torch(pairs)
    outs = np.stack([_float64(o) for o, _ in pairs])  # [P, ..., H, d]
    lses = np.stack([_float64(s) for _, s in pairs])  # [P, ..., H]
    top = lses.max(axis=0)
    safe = np.where(np.isneginf(top), 0.0, top)  # no key anywhere: every weight 0
    w = np.exp(lses - safe)
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[..., None] > 0, (w[..., None] * outs).sum(axis=0) / total[..., None], 0.0)
        lse = np.where(total > 0, safe + np.log(total), -np.inf)
    return Attention(out.astype(np.float32), lse.astype(np.float32))


def _float64(a: Any) -> np.ndarray:
    """A numpy part as float64 (a bfloat16 one widened from its bits)."""
    arr = np.asarray(a)
    return (wire.to_float32(arr) if arr.dtype == wire.BFLOAT16 else arr).astype(np.float64)


def _merge_torch(pairs: list[tuple[Any, Any]]) -> Attention:
    torch = tensors._torch()
    out0 = pairs[0][0]
    work = torch.float64 if out0.dtype == torch.float64 else torch.float32
    outs = torch.stack([o.to(device=out0.device, dtype=work) for o, _ in pairs])
    lses = torch.stack([s.to(device=out0.device, dtype=work) for _, s in pairs])
    top = lses.amax(dim=0)
    safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w = torch.exp(lses - safe)
    total = w.sum(dim=0)
    has = total > 0
    out = (w[..., None] * outs).sum(dim=0) / torch.where(has, total, torch.ones_like(total))[..., None]
    lse = torch.where(has, safe + torch.log(torch.where(has, total, torch.ones_like(total))), -torch.inf)
    return Attention(out.to(out0.dtype), lse.to(out0.dtype))
