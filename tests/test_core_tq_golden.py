"""A ``turboquant`` snapshot written before the format moved to the ``tqx`` kernels
still loads and gives the same answers.

``tests/data/turboquant-golden.npz`` holds two sessions' snapshot blobs (written
by the turboquant-only kernels, since retired), queries, and the outputs those
kernels gave on the split (decode) path. Restored, each layer's words read back
exactly as stored, and attention on every path meets the float64 oracle of those
words and the stored outputs within the tolerance of ``test_core_attention.py``.

    PYTHONPATH=service:client:. python tests/test_core_tq_golden.py --write
    (regenerates it: only ever with the kernels that wrote it)
"""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import numpy as np
import pytest

from attnserve import snapshot_format as SF
from attnserve.formats import TQ_SPECS, key_words, value_words
from tools import reference as ref
from attnserve.turboquant import layer_signs

from _core import read_words, rel_err

pytestmark = pytest.mark.gpu

GOLDEN = Path(__file__).resolve().parent / "data" / "turboquant-golden.npz"
TQ_TOL = 1e-4  # test_core_attention.py: max abs error over the oracle's max abs value
PATHS = ("split", "split-long", "tiled", "single")
# (num_layers, num_qo_heads, num_kv_heads, head_dim, length, seed)
SESSIONS = ((2, 8, 2, 128, 200, 0x5EED), (1, 6, 3, 32, 97, 12345))


def _queries(length):
    """(n, start_pos, causal) of the attends of each layer."""
    return ((3, length - 3, True), (2, length // 3, True), (1, length - 1, False))


def _used(words, regions, hkv, cap, n):
    """The words of slots ``[head, 0 .. n)`` of every region, region by region."""
    out, base = [], 0
    for w in regions:
        out.append(words[base : base + hkv * cap * w].reshape(hkv, cap, w)[:, :n].ravel())
        base += hkv * cap * w
    assert base == words.size
    return np.concatenate(out)


def _policy(engine, p):
    return dataclasses.replace(
        engine.policy,
        force="tiled" if p == "tiled" else p if p == "single" else "split",
        target_workgroups=1 if p.endswith("long") else engine.policy.target_workgroups,
    )


def _attends(engine, kv, qs, length):
    outs = []
    for layer, lq in zip(kv.layers, qs):
        for q, (n, sp, causal) in zip(lq, _queries(length)):
            scale = (1.0 if causal else 0.7) / np.sqrt(q.shape[2])
            outs.append(engine.attend(layer, q, start_pos=sp, causal=causal, scale=scale))
    return [np.array(f.result()[0]) for f in outs]


def write_golden(engine) -> None:
    from attnserve.kv.config import SessionConfig

    data: dict[str, np.ndarray] = {}
    saved = engine.policy
    for i, (layers, h, hkv, d, length, seed) in enumerate(SESSIONS):
        rng = np.random.default_rng(seed)
        kv = engine.session_kv(SessionConfig(layers, h, hkv, d, "turboquant", 1024, seed))
        for layer in kv.layers:
            k = rng.standard_normal((length, hkv, d), dtype=np.float32)
            v = rng.standard_normal((length, hkv, d), dtype=np.float32)
            engine.append(layer, k[: length // 2], v[: length // 2]).result()
            engine.append(layer, k[length // 2 :], v[length // 2 :]).result()
        blob = SF.build_blob(kv.config, engine.call(SF.read_layers(kv)).result())
        data[f"s{i}.blob"] = np.frombuffer(blob, np.uint8)
        qs = [[rng.standard_normal((n, h, d), dtype=np.float32) for n, _, _ in _queries(length)] for _ in kv.layers]
        for li, lq in enumerate(qs):
            for j, q in enumerate(lq):
                data[f"s{i}.l{li}.q{j}"] = q
        engine.policy = _policy(engine, "split")  # the decode path (every path agreed with it to ~1e-6)
        for j, out in enumerate(_attends(engine, kv, qs, length)):
            data[f"s{i}.out{j}"] = out
        engine.policy = saved
        engine.release(kv).result()
    GOLDEN.parent.mkdir(exist_ok=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, **data)
    GOLDEN.write_bytes(buf.getvalue())


@pytest.fixture(params=PATHS)
def path(request, engine):
    """The kernel path the attends take (the engine's policy while the test runs)."""
    saved = engine.policy
    engine.policy = _policy(engine, request.param)
    yield request.param
    engine.policy = saved


def test_an_old_turboquant_snapshot_gives_the_same_answers(engine, path):
    data = np.load(GOLDEN)
    worst = {"oracle": 0.0, "stored": 0.0}
    for i, (layers, h, hkv, d, length, seed) in enumerate(SESSIONS):
        blob = data[f"s{i}.blob"].tobytes()
        config, stored = SF.parse_blob(blob, len(blob) + 1, lambda *_: 1 << 20)
        assert config.kv_format == "turboquant" and config.seed == seed
        kv = engine.session_kv(config)
        engine.call(lambda ctx: SF.load(ctx, kv, stored)).result()
        try:
            for layer, (n, cap, kb, vb) in zip(kv.layers, stored):
                kw, vw = read_words(engine, layer)
                assert n == length and layer.length == length
                # the words as stored (the capacity may differ: compare the used slots' words)
                for got, raw, regions in ((kw, kb, key_words("turboquant", 1, d)),
                                          (vw, vb, value_words("turboquant", 1, d))):  # fmt: skip
                    want = np.frombuffer(raw, np.uint32)
                    np.testing.assert_array_equal(
                        _used(got, regions, hkv, layer.capacity, n), _used(want, regions, hkv, cap, n)
                    )
            qs = [[data[f"s{i}.l{li}.q{j}"] for j in range(len(_queries(length)))] for li in range(layers)]
            outs = _attends(engine, kv, qs, length)
            j = 0
            for li, layer in enumerate(kv.layers):
                kw, vw = read_words(engine, layer)
                ps, js = layer_signs(seed, li, d)
                for q, (n, sp, causal) in zip(qs[li], _queries(length)):
                    scale = (1.0 if causal else 0.7) / np.sqrt(d)
                    want = ref.tqx_attention(
                        q, kw, vw, TQ_SPECS["turboquant"], n_kv_heads=hkv, cap=layer.capacity, length=length,
                        polar_signs=ps, jl_signs=js, start_pos=sp, causal=causal, scale=scale,
                    )  # fmt: skip
                    e_oracle, e_stored = rel_err(outs[j], want), rel_err(outs[j], data[f"s{i}.out{j}"])
                    assert e_oracle <= TQ_TOL and e_stored <= TQ_TOL, (i, li, sp, causal, e_oracle, e_stored)
                    worst = {"oracle": max(worst["oracle"], e_oracle), "stored": max(worst["stored"], e_stored)}
                    j += 1
        finally:
            engine.release(kv).result()
    print(f"{path}: worst relative error vs the oracle and vs the stored outputs", worst)


if __name__ == "__main__" and "--write" in sys.argv:
    import os

    from attnserve.engine import Engine
    from _core import CORE_PAGE_TOKENS

    eng = Engine.open(os.environ.get("ATTNSERVE_ADAPTER") or None, page_tokens=CORE_PAGE_TOKENS)
    try:
        write_golden(eng)
    finally:
        eng.close()
    print("wrote", GOLDEN, GOLDEN.stat().st_size, "bytes")
