"""``turboquant`` served by its ``tqx`` instance (TqSpec(2, True, 2)) equals the
turboquant-only kernels: the proof asked for before those kernels are retired.

* the constants: the tqx instance's codebooks and boundaries (``tqx_consts``) are
  the float32 values the turboquant encoder gets in its params block;
* the encoders: the same rows (awkward ones included: zero, one-hot, constant,
  tiny and large) through ``tq_encode_*`` and ``tqx_encode_*.turboquant`` give the
  same packed words, bit for bit, over the whole slab;
* attention: on one cache, every kernel path (split, split with long splits,
  split-sg, tiled, single) of both families meets the float64 oracle of the
  cache's words within the tolerance of ``test_core_attention.py``, and the two
  families agree within it too.

The family is chosen by ``gpu.kernels.OWN_KERNELS`` (the one owner of that
decision): this test sets it while its jobs are planned.
"""

from __future__ import annotations

import contextlib
import itertools
import re

import numpy as np
import pytest

from attnserve.formats import TQ_HEAD_DIMS
from attnserve.gpu import kernels as K
from attnserve.gpu.batch import Batch
from attnserve.gpu.shaders import KERNELS, load_wgsl, tqx_consts, tqx_kernel
from attnserve.testing import reference as ref
from attnserve.turboquant import CODEBOOK, codebook, layer_signs

from _core import read_words, rel_err, reserve, rows, session
from test_core_tqx import path  # noqa: F401  (the kernel path fixture)

pytestmark = pytest.mark.gpu

TQ_TOL = 1e-4  # test_core_attention.py: max abs error over the oracle's max abs value


@contextlib.contextmanager
def family(name: str):
    """Plan turboquant's jobs on the turboquant-only kernels ("tq") or on its tqx
    instance ("tqx"); check that the batches dispatched that family's kernels only."""
    saved, dispatch = K.OWN_KERNELS, Batch.dispatch
    used: set[str] = set()

    def spy(self, kernel, *args, **kw):
        used.add(kernel)
        return dispatch(self, kernel, *args, **kw)

    K.OWN_KERNELS = frozenset({"turboquant"}) if name == "tq" else frozenset()
    Batch.dispatch = spy
    try:
        yield
    finally:
        K.OWN_KERNELS, Batch.dispatch = saved, dispatch
    shared = {"tq_rotate_q", "attention_merge"}
    if name == "tq":
        assert used and all(k in shared or "." not in k for k in used), used
    else:
        assert used and all(k in shared or k.endswith(".turboquant") for k in used), used


def _consts(src: str) -> dict[str, np.ndarray | str]:
    out: dict[str, np.ndarray | str] = {}
    for name, body in re.findall(r"const (\w+)(?:: \w+)? = ([^;]+);", src):
        if body.startswith("array<f32, 16>("):
            out[name] = np.array([float(x.rstrip("f")) for x in body[15:-1].split(", ")], np.float32)
        else:
            out[name] = body
    return out


def test_the_tqx_instance_carries_turboquants_constants():
    c = _consts(tqx_consts("turboquant"))
    assert (c["KB"], c["VB"], c["QJL"], c["KO"], c["VO"]) == ("2u", "2u", "true", "0u", "0u")
    for d in TQ_HEAD_DIMS:
        cb = CODEBOOK[d]  # what the turboquant encoder and kernels get in their params blocks
        assert cb is codebook(d, 2)
        for kind in "KV":
            np.testing.assert_array_equal(c[f"{kind}C_{d}"][:4], cb.centroids_f32())
            np.testing.assert_array_equal(c[f"{kind}CB_{d}"][:3], cb.boundaries_f32())
            assert not c[f"{kind}C_{d}"][4:].any() and not c[f"{kind}CB_{d}"][3:].any()
    # the literals are the float32 values exactly (no rounding in the WGSL parse)
    for d in TQ_HEAD_DIMS:
        for x in CODEBOOK[d].centroids + CODEBOOK[d].boundaries:
            assert float(np.float32(x)) == x
    # and every tqx kernel of the instance is registered and reads these constants
    for base in ("tqx_encode_keys", "tqx_encode_values", "flash_attention_tqx", "attention_tqx_tiled",
                 "attention_split_tqx", "attention_split_tqx_sg"):  # fmt: skip
        spec = KERNELS[tqx_kernel(base, "turboquant")]
        assert dict(spec.defines)["TQX_CONSTS"] == tqx_consts("turboquant")
        assert "const QJL: bool = true;" in load_wgsl(spec.file, spec.defines)


def _awkward_rows(rng, n, hkv, d):
    """Random rows at three scales, with zero, one-hot, constant, integer, tiny and
    large rows mixed in (every slot of a few timesteps)."""
    x = rows(rng, n, hkv, d, float(rng.choice([0.01, 1.0, 30.0])))
    kinds = itertools.cycle(("zero", "onehot", "const", "int", "tiny", "large", "neg-onehot"))
    for t in range(0, n, 5):
        for h in range(hkv):
            kind = next(kinds)
            if kind == "zero":
                x[t, h] = 0.0
            elif kind in ("onehot", "neg-onehot"):
                x[t, h] = 0.0
                x[t, h, int(rng.integers(d))] = 1.0 if kind == "onehot" else -3.0
            elif kind == "const":
                x[t, h] = 0.5
            elif kind == "int":
                x[t, h] = rng.integers(-3, 4, d)
            elif kind == "tiny":
                x[t, h] *= 1e-6
            else:
                x[t, h] *= 100.0 / max(float(np.linalg.norm(x[t, h])), 1e-30)  # norm 100
    return x


@pytest.mark.parametrize("d", [32, 64, 128])
def test_encoders_write_the_same_words(engine, rng, d):
    """The same rows, the same layer (seed, index), appended in the same pieces: the
    whole K and V slabs (the rows past the length too) are equal, bit for bit. (The
    words against the float64 oracle: test_core_turboquant.py; the awkward rows here
    put coordinates on boundaries and JL projections at zero on purpose.)"""
    hkv = 3
    for length in (1, 7, 16, 97, 300):
        seed = int(rng.integers(2**53))
        k, v = _awkward_rows(rng, length, hkv, d), _awkward_rows(rng, length, hkv, d)
        cuts = sorted({0, length, *rng.integers(1, length + 1, 2).tolist()})
        words = {}
        for fam in ("tq", "tqx"):
            s = session(engine, "turboquant", 6, hkv, d, layers=3, seed=seed)
            layer = s.layers[2]  # sign_off != 0
            with family(fam):
                for a, b in itertools.pairwise(cuts):
                    engine.append(layer, k[a:b], v[a:b]).result()
            words[fam] = read_words(engine, layer)
            assert layer.length == length
            engine.release(s).result()
        for i, part in enumerate("KV"):
            assert words["tq"][i].shape == words["tqx"][i].shape
            np.testing.assert_array_equal(words["tqx"][i], words["tq"][i], err_msg=f"{part} d {d} length {length}")


LENGTHS = (1, 54, 97, 300, 600)


@pytest.mark.parametrize("path", ("split", "split-long", "split-sg", "tiled", "single"), indirect=True)
def test_both_families_meet_the_oracle_on_one_cache(engine, rng, path):  # noqa: F811
    """GQA 1/2/4/8 (and 3, which only the single-pass kernels take), d 32/64/128 in
    turn, causal and not, start_pos inside, capacity > length; many cases in one
    batch per family."""
    cases = []
    dims = itertools.cycle(TQ_HEAD_DIMS)
    ratios = (1, 2, 4, 8, 3) if path == "single" else (1, 2, 4, 8)
    for length, ratio in itertools.product(LENGTHS, ratios):
        d = next(dims)
        hkv = {1: 3, 2: 2, 3: 2, 4: 2, 8: 1}[ratio]
        h = hkv * ratio
        s = session(engine, "turboquant", h, hkv, d, layers=2, max_tokens=2048, seed=int(rng.integers(2**53)))
        layer = s.layers[1]
        reserve(engine, layer, length + 37)
        with family("tq"):
            engine.append(layer, rows(rng, length, hkv, d), rows(rng, length, hkv, d)).result()
        n = min(3, length)
        for sp, causal in ((length - n, True), (length // 3, True), (length - n, False)):
            nq = n if sp == length - n else min(2, length)
            scale = (1.0 if causal else 0.7) / np.sqrt(d)
            cases.append((s, layer, rows(rng, nq, h, d), sp, causal, scale, (length, ratio, d)))
    out = {}
    for fam in ("tq", "tqx"):
        with family(fam):
            futs = [engine.attend(layer, q, start_pos=sp, causal=c, scale=sc) for _, layer, q, sp, c, sc, _ in cases]
            out[fam] = [np.array(f.result()[0]) for f in futs]
    worst = {"tq": 0.0, "tqx": 0.0, "between": 0.0}
    for i, (s, layer, q, sp, causal, scale, case) in enumerate(cases):
        d = q.shape[2]
        kw, vw = read_words(engine, layer)
        ps, js = layer_signs(s.config.seed, layer.layer, d)
        want = ref.tq_attention(
            q, kw, vw, n_kv_heads=layer.n_kv_heads, cap=layer.capacity, length=layer.length,
            polar_signs=ps, jl_signs=js, cb=codebook(d), start_pos=sp, causal=causal, scale=scale,
        )  # fmt: skip
        for fam in ("tq", "tqx"):
            err = rel_err(out[fam][i], want)
            worst[fam] = max(worst[fam], err)
            assert err <= TQ_TOL, (fam, case, sp, causal, err)
        between = rel_err(out["tqx"][i], out["tq"][i])
        worst["between"] = max(worst["between"], between)
        assert between <= TQ_TOL, (case, sp, causal, between)
    print(f"{path}: worst relative error vs the float64 oracle and between the families", worst)
