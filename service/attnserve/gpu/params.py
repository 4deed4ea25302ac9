"""Every shader's params block, in one place: the host packing and the WGSL struct.

Each block is a numpy structured dtype of 4-byte fields (``f4`` is ``f32``,
everything else ``u32``). The host packs it with ``pack``; the shaders get the
same fields, in the same order, as a WGSL struct generated from it
(``wgsl_struct``, named in ``STRUCTS``), which a shader declares with a line
``// #struct NAME`` that the loader (``shaders.py``) expands. The binding is the
same buffer of words either way, so the two sides cannot disagree on a layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "FLAG_NON_CAUSAL",
    "PREFILL_PARAMS",
    "TQ_ATTENTION_PARAMS",
    "TQX_ENCODE_PARAMS",
    "TQ_ROTATE_PARAMS",
    "SPLIT_PARAMS",
    "TQ_SPLIT_PARAMS",
    "MERGE_PARAMS",
    "KV_WRITE_PARAMS",
    "CONVERT_PARAMS",
    "PARAMS_OF",
    "STRUCTS",
    "pack",
    "pack_array",
    "wgsl_struct",
]

FLAG_NON_CAUSAL = 1  # bit 0 of `flags` in both attention kernels


def _block(*fields: str) -> np.dtype:
    return np.dtype([(f[1:], "<f4") if f.startswith("~") else (f, "<u4") for f in fields])


# The heads the f32 and the TurboQuant attention blocks share (the shaders' structs
# start alike; kernels.Attend.shape_params fills them).
_F32_HEAD = ("n_heads", "n_kv_heads", "head_dim", "kv_dim", "max_seq", "~scale", "start_pos")
_TQ_HEAD = ("n_heads", "n_kv_heads", "head_dim", "max_seq", "start_pos", "~scale", "q_cap")


# struct PrefillParams: attention_prefill{,_tiled,_rb}.wgsl `params` (the query-block
# kernels take one per block: q_base is the block's first row; q_off/out_off the
# item's queries and outputs in the bound arenas)
PREFILL_PARAMS = _block(
    *_F32_HEAD,
    "n_queries",
    "q_stride",
    "out_stride",
    "q_base",
    "flags",
    "table_off",
    "page_shift",
    "q_off",
    "out_off",
)


# struct TqAttentionParams: flash_attention_tqx{,_tiled}.wgsl `params` (one per block
# in attention_tqx_tiled, as PrefillParams)
TQ_ATTENTION_PARAMS = _block(
    *_TQ_HEAD,
    "out_stride",
    "~qjl_scale",
    "sign_off",
    "q_base",
    "cache_cap",
    "flags",
    "table_off",
    "page_shift",
    "q_off",
    "out_off",
)

# struct TqxEncodeParams: tqx.wgsl tqx_encode_keys / tqx_encode_values `eparams`, one
# block per row: the row at word src_off goes to timestep t of its layer (the
# format's codebooks are constants of its kernels)
TQX_ENCODE_PARAMS = _block(
    "n_kv_heads",
    "head_dim",
    "cache_cap",
    "t",
    "src_off",
    "sign_off",
    "table_off",
    "page_shift",
)

# struct KvWriteParams: kv_write.wgsl kv_write_rows `wparams`, one block per row: the
# row's keys at word src_off and values at v_off go to timestep t of its layer
# (row_words words each; the plain kv formats)
KV_WRITE_PARAMS = _block(
    "row_words",
    "t",
    "src_off",
    "v_off",
    "table_off",
    "page_shift",
    "_pad0",
    "_pad1",
)

# struct TqRotateParams: tq_rotate.wgsl tq_rotate_q `rparams`, one block per query
# row: row q_row of the item whose queries start at word q_in_off (rotated: q_out_off)
TQ_ROTATE_PARAMS = _block(
    "n_heads",
    "head_dim",
    "q_cap",
    "sign_off",
    "q_row",
    "q_stride",
    "q_in_off",
    "q_out_off",
)

# The fields both split blocks end with: the GQA group of the cache's KV heads
# (kv_group; a workgroup serves n_heads / n_kv_heads query heads of one of them),
# and where a part of an attend reads and writes (a windowed attend's compressed
# band and exact rows are parts of one item; a plain attend is one part):
# timesteps from t_lo, cache row 0 holding timestep row_base, its splits
# split_base .. of the item's split_total in the partials.
_SPLIT_PART = ("kv_group", "t_lo", "row_base", "split_base", "split_total")

# struct SplitParams: attention_split.wgsl `params`, one block per query row
# of a batch: row q_row of the item whose queries start at word q_off, partials at part_off
SPLIT_PARAMS = _block(
    *_F32_HEAD,
    "split_len",
    "q_stride",
    "n_splits",
    "q_row",
    "flags",
    "q_total",
    "q_off",
    "part_off",
    "table_off",
    "page_shift",
    *_SPLIT_PART,
    "_pad0",
)

# struct TqSplitParams: flash_attention_tqx_split.wgsl `params`, one block per
# query row of a batch (as SplitParams; q_off: the item's rotated queries)
TQ_SPLIT_PARAMS = _block(
    *_TQ_HEAD,
    "split_len",
    "~qjl_scale",
    "n_splits",
    "q_row",
    "cache_cap",
    "flags",
    "table_off",
    "page_shift",
    "q_off",
    "part_off",
    *_SPLIT_PART,
    "_pad0",
)

# struct MergeParams: attention_merge.wgsl `mparams`, one block per query row of a
# batch: row q_row of the item whose partials start at word part_off, output at out_off
MERGE_PARAMS = _block(
    "n_heads",
    "head_dim",
    "n_splits",
    "q_total",
    "q_row",
    "out_stride",
    "sign_off",
    "flags",
    "part_off",
    "out_off",
    "n_rotated",  # with ROTATE: splits [0, n_rotated) are rotated, the rest (exact rows) not
    "_pad0",
)

FLAG_ROTATE = 1  # attention_merge: apply the TurboQuant inverse rotation

# struct ConvertParams: convert.wgsl `cparams`, one block per array converted (the
# dispatch's workgroup_id.y): `total` elements in items of `per_item`, from word
# src_base (stride: words per item, 0: contiguous) to word dst_base (dst_stride
# likewise), of kind src_kind to dst_kind (0 float32, 1 float16, 2 bfloat16)
CONVERT_PARAMS = _block("total", "per_item", "src_base", "src_stride", "dst_base", "dst_stride", "src_kind", "dst_kind")

# WGSL struct name -> block, for `// #struct NAME` in the shaders
STRUCTS = {
    "PrefillParams": PREFILL_PARAMS,
    "TqAttentionParams": TQ_ATTENTION_PARAMS,
    "TqxEncodeParams": TQX_ENCODE_PARAMS,
    "TqRotateParams": TQ_ROTATE_PARAMS,
    "SplitParams": SPLIT_PARAMS,
    "TqSplitParams": TQ_SPLIT_PARAMS,
    "MergeParams": MERGE_PARAMS,
    "KvWriteParams": KV_WRITE_PARAMS,
    "ConvertParams": CONVERT_PARAMS,
}

# (shader file, the params variable) -> block, for the layout test
PARAMS_OF = {
    ("attention_prefill.wgsl", "params"): PREFILL_PARAMS,
    ("attention_prefill_tiled.wgsl", "params"): PREFILL_PARAMS,
    ("attention_prefill_rb.wgsl", "params"): PREFILL_PARAMS,
    ("tq_rotate.wgsl", "rparams"): TQ_ROTATE_PARAMS,
    ("attention_split.wgsl", "params"): SPLIT_PARAMS,
    ("attention_merge.wgsl", "mparams"): MERGE_PARAMS,
    ("tqx.wgsl", "eparams"): TQX_ENCODE_PARAMS,
    ("kv_write.wgsl", "wparams"): KV_WRITE_PARAMS,
    ("convert.wgsl", "cparams"): CONVERT_PARAMS,
    ("flash_attention_tqx.wgsl", "params"): TQ_ATTENTION_PARAMS,
    ("flash_attention_tqx_tiled.wgsl", "params"): TQ_ATTENTION_PARAMS,
    ("flash_attention_tqx_split.wgsl", "params"): TQ_SPLIT_PARAMS,
}


def pack(dtype: np.dtype, **values: Any) -> bytes:
    """One params block as bytes (:func:`pack_array` of one)."""
    return pack_array(dtype, 1, **values).tobytes()


def pack_array(dtype: np.dtype, n: int, **columns: Any) -> np.ndarray:
    """``n`` params blocks as one structured array (a batched kernel's one block per
    row): each column is a scalar (the same in every block) or a sequence of ``n``
    values; fields not given are zero, unknown names raise."""
    rec = np.zeros(n, dtype=dtype)
    names = dtype.names
    assert names is not None, "a params block is a structured dtype"
    for name, value in columns.items():
        if name not in names:
            raise KeyError(f"{name!r} is not a field of this params block {dtype.names}")
        rec[name] = value
    return rec


def wgsl_struct(name: str) -> str:
    """The WGSL declaration of the block ``STRUCTS[name]``: one field a word, in
    the host's order, so its offsets are the dtype's (checked here)."""
    dtype = STRUCTS[name]
    names, fields = dtype.names, dtype.fields
    assert names is not None and fields is not None, "a params block is a structured dtype"
    lines = [f"// {name}: generated from attnserve/gpu/params.py, one 4-byte word a field", f"struct {name} {{"]
    for i, field in enumerate(names):
        kind, offset = fields[field][0], fields[field][1]
        if offset != 4 * i or kind.itemsize != 4:
            raise ValueError(f"{name}.{field}: not word {i} of the block")
        lines.append(f"    {field}: {'f32' if kind.kind == 'f' else 'u32'},")
    lines.append("}")
    return "\n".join(lines)
