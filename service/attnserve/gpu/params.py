"""Host mirrors of every shader's params block, in one place.

Each block is a numpy structured dtype whose field names are the names the WGSL
gives the words (``let NAME = params[i]``), so a test can check sizes and offsets
against the shader source. ``f4`` fields are read in WGSL through
``bitcast<f32>(...)``; everything else is ``u32``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FLAG_NON_CAUSAL",
    "PREFILL_PARAMS",
    "TQ_ATTENTION_PARAMS",
    "TQ_ENCODE_PARAMS",
    "TQ_ROTATE_PARAMS",
    "SPLIT_PARAMS",
    "TQ_SPLIT_PARAMS",
    "MERGE_PARAMS",
    "PARAMS_OF",
    "pack",
]

FLAG_NON_CAUSAL = 1  # bit 0 of `flags` in both attention kernels


def _block(*fields: str) -> np.dtype:
    return np.dtype([(f[1:], "<f4") if f.startswith("~") else (f, "<u4") for f in fields])


# attention_prefill.wgsl, params: array<u32, 12>
PREFILL_PARAMS = _block(
    "n_heads", "n_kv_heads", "head_dim", "kv_dim", "max_seq", "~scale",
    "start_pos", "n_queries", "q_stride", "out_stride", "q_base", "flags",
)

# flash_attention_tq.wgsl, params: array<u32, 20>
TQ_ATTENTION_PARAMS = _block(
    "n_heads", "n_kv_heads", "head_dim", "max_seq", "start_pos", "~scale",
    "q_cap", "out_stride", "~qjl_scale", "sign_off",
    "~c0", "~c1", "~c2", "~c3", "q_base", "cache_cap",
    "flags", "_pad0", "_pad1", "_pad2",
)

# turboquant.wgsl tq_encode_keys / tq_encode_values, eparams: array<u32, 16>
TQ_ENCODE_PARAMS = _block(
    "n_kv_heads", "head_dim", "cache_cap", "t0", "row_base", "sign_off", "n_rows", "_pad0",
    "~c0", "~c1", "~c2", "~c3", "~b0", "~b1", "~b2", "_pad1",
)

# turboquant.wgsl tq_rotate_q, rparams: array<u32, 8>
TQ_ROTATE_PARAMS = _block(
    "n_heads", "head_dim", "q_cap", "sign_off", "q_base", "q_stride", "_pad0", "_pad1",
)

# attention_split.wgsl, params: array<u32, 16>
SPLIT_PARAMS = _block(
    "n_heads", "n_kv_heads", "head_dim", "kv_dim", "max_seq", "~scale", "start_pos",
    "split_len", "q_stride", "n_splits", "q_base", "flags", "q_total", "_pad0", "_pad1", "_pad2",
)

# flash_attention_tq_split.wgsl, params: array<u32, 20>
TQ_SPLIT_PARAMS = _block(
    "n_heads", "n_kv_heads", "head_dim", "max_seq", "start_pos", "~scale", "q_cap",
    "split_len", "~qjl_scale", "n_splits", "~c0", "~c1", "~c2", "~c3",
    "q_base", "cache_cap", "flags", "_pad0", "_pad1", "_pad2",
)

# attention_merge.wgsl, mparams: array<u32, 8>
MERGE_PARAMS = _block(
    "n_heads", "head_dim", "n_splits", "q_total", "q_base", "out_stride", "sign_off", "flags",
)

FLAG_ROTATE = 1  # attention_merge: apply the TurboQuant inverse rotation

# (shader file, the params variable) -> dtype, for the layout test
PARAMS_OF = {
    ("attention_prefill.wgsl", "params"): PREFILL_PARAMS,
    ("attention_prefill_tiled.wgsl", "params"): PREFILL_PARAMS,
    ("attention_prefill_rb.wgsl", "params"): PREFILL_PARAMS,
    ("flash_attention_tq.wgsl", "params"): TQ_ATTENTION_PARAMS,
    ("flash_attention_tq_tiled.wgsl", "params"): TQ_ATTENTION_PARAMS,
    ("turboquant.wgsl", "eparams"): TQ_ENCODE_PARAMS,
    ("turboquant.wgsl", "rparams"): TQ_ROTATE_PARAMS,
    ("attention_split.wgsl", "params"): SPLIT_PARAMS,
    ("flash_attention_tq_split.wgsl", "params"): TQ_SPLIT_PARAMS,
    ("attention_merge.wgsl", "mparams"): MERGE_PARAMS,
}


def pack(dtype: np.dtype, **values) -> bytes:
    """One params block as bytes; fields not given are zero, unknown names raise."""
    rec = np.zeros((), dtype=dtype)
    for name, value in values.items():
        if name not in dtype.names:
            raise KeyError(f"{name!r} is not a field of this params block {dtype.names}")
        rec[name] = value
    return rec.tobytes()
