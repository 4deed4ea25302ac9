"""Exact sinks and a recent window over a TurboQuant layer (issue 27,
``kv.windowed.WindowedLayerCache``, ``kernels.plan_split_windowed``): every attend against
the float64 oracle (``reference.windowed_attention`` over the GPU's own codes and the
rows as sent), at awkward lengths across page boundaries, GQA groups the split
kernels serve whole and one they do not; the exact rows' pages let go as the window
moves on; a stacked step bit-identical to the same attends one by one."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.formats import TQ_SPECS
from attnserve.kv.config import SessionConfig
from attnserve.kv.windowed import WindowedLayerCache
from tools import reference as ref
from attnserve.turboquant import layer_signs

from _core import CORE_PAGE_TOKENS, lse_err, read_words, rel_err, rows

TOL = 1e-4  # as the tqx kernels against their oracle (test_core_tqx.TQ_TOL)


def windowed(engine, fmt, h, hkv, d, sinks, window, *, seed=5, layers=2, max_tokens=512):
    kv = engine.session_kv(SessionConfig(layers, h, hkv, d, fmt, max_tokens, seed, sinks=sinks, window=window))
    layer = kv.layers[1]  # sign_off != 0
    assert isinstance(layer, WindowedLayerCache)
    return kv, layer


class Follow:
    """The rows a windowed layer was sent and the oldest row its window holds
    (after a call: its last ``window`` rows), to compute each attend's oracle."""

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.held_from = 0

    def append(self, k, v) -> None:
        self.k.append(k)
        self.v.append(v)

    def call_done(self) -> None:
        if self.window:
            self.held_from = max(self.held_from, sum(len(x) for x in self.k) - self.window)

    def want(self, engine, kv, layer, q, start_pos, length, causal=True, scale=None, return_lse=False):
        kw, vw = read_words(engine, layer)
        d = q.shape[2]
        ps, js = layer_signs(kv.config.seed, layer.layer, d)
        k_hat, v_hat = ref.tqx_decoded_rows(
            kw, vw, TQ_SPECS[layer.kv_format], n_kv_heads=layer.n_kv_heads, cap=layer.capacity, d=d, length=length,
            polar_signs=ps, jl_signs=js,
        )  # fmt: skip
        k, v = np.concatenate(self.k)[:length], np.concatenate(self.v)[:length]
        ef = ref.exact_from(start_pos, self.sinks, self.window, self.held_from)
        return ref.windowed_attention(
            q, k, v, k_hat, v_hat, sinks=self.sinks, exact_from=ef, start_pos=start_pos, causal=causal, scale=scale,
            return_lse=return_lse,
        )  # fmt: skip


@pytest.mark.parametrize(
    "fmt,h,hkv,d,sinks,window",
    [("tq4", 9, 3, 64, 3, 5), ("turboquant", 8, 2, 32, 4, 21), ("tq4o", 4, 4, 128, 0, 7), ("tq3", 6, 2, 64, 17, 0)],
)
# conftest's kernel policies: the split kernels, one long split per attend, and a
# policy that forces single-pass (a windowed layer takes the split
# kernels whatever the policy says)
@pytest.mark.parametrize("kernel_path", ["split", "split-long", "single"], indirect=True)
def test_every_attend_matches_the_oracle(engine, rng, kernel_path, fmt, h, hkv, d, sinks, window):
    """Fused appends of awkward sizes (prefill chunks across page borders, then
    decode steps), separate appends and attends, attends from an earlier row and
    non-causal ones: each against the oracle of what the layer holds."""
    kv, layer = windowed(engine, fmt, h, hkv, d, sinks, window)
    follow = Follow(sinks, window)
    length = 0
    worst = 0.0
    for n in (7, 19, 1, 1, 33, 1, 1, 1, 2, 1, 16, 1, 1):
        q, k, v = rows(rng, n, h, d), rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        follow.append(k, v)
        res = engine.attend(layer, q, k=k, v=v).result()
        out, got_len = res
        length += n
        assert got_len == length
        want, want_lse = follow.want(engine, kv, layer, q, length - n, length, return_lse=True)
        err = rel_err(out, want)
        follow.call_done()
        worst = max(worst, err)
        assert err <= TOL, (n, length, err)
        # the merge's log-sum-exp over the codes, the sinks and the window together
        assert lse_err(res.lse, want_lse) <= TOL, (n, length, lse_err(res.lse, want_lse))
    # an append alone, then attends of its rows; from an earlier row; not causal
    k, v = rows(rng, 3, hkv, d), rows(rng, 3, hkv, d)
    follow.append(k, v)
    engine.append(layer, k, v).result()
    follow.call_done()
    length += 3
    for n, sp, causal in ((3, length - 3, True), (2, length - 9, True), (4, length - 4, False), (1, 2, True)):
        q = rows(rng, n, h, d)
        res = engine.attend(layer, q, start_pos=sp, causal=causal, scale=0.2).result()
        want, want_lse = follow.want(engine, kv, layer, q, sp, length, causal, 0.2, return_lse=True)
        assert lse_err(res.lse, want_lse) <= TOL, (n, sp, causal, lse_err(res.lse, want_lse))
        out = res.out
        err = rel_err(out, want)
        follow.call_done()
        worst = max(worst, err)
        assert err <= TOL, (n, sp, causal, err)
    print(f"worst {fmt} windowed relative error vs own oracle", worst)
    engine.release(kv).result()


def test_the_exact_rows_are_exact(engine, rng):
    """A window longer than the session: every row is read as sent, so the output
    is exact attention (float32 arithmetic); without it, the codes' error shows."""
    h, hkv, d, L = 8, 2, 64, 45
    q, k, v = rows(rng, L, h, d), rows(rng, L, hkv, d), rows(rng, L, hkv, d)
    kv, layer = windowed(engine, "tq3", h, hkv, d, 0, 1000)
    chunks = [out for out, _ in (engine.attend(layer, q[i : i + 9], k=k[i : i + 9], v=v[i : i + 9]).result()
                                 for i in range(0, L, 9))]  # fmt: skip
    exact = ref.attention(q, k, v)
    assert rel_err(np.concatenate(chunks), exact) <= 2e-6
    plain = engine.session_kv(SessionConfig(1, h, hkv, d, "tq3", 512, 5))
    coded, _ = engine.attend(plain.layers[0], q, k=k, v=v).result()
    assert rel_err(coded, exact) > 1e-2  # the codes alone are 3 bits: the test can tell
    for s in (kv, plain):
        engine.release(s).result()


def test_the_window_lets_old_pages_go(engine, rng):
    """Decoding far past the window: between calls the exact rows' pages stay a
    few (the window's plus one, and the sinks'), while the codes grow; the bytes
    the layer is charged are those; the oracle still holds at the end."""
    h, hkv, d, sinks, window = 4, 2, 32, 2, 20
    kv, layer = windowed(engine, "tq4", h, hkv, d, sinks, window)
    follow = Follow(sinks, window)
    P = CORE_PAGE_TOKENS
    for i in range(150):
        n = 11 if i == 0 else 1
        q, k, v = rows(rng, n, h, d), rows(rng, n, hkv, d), rows(rng, n, hkv, d)
        follow.append(k, v)
        start = sum(len(x) for x in follow.k) - n
        out, length = engine.attend(layer, q, k=k, v=v).result()
        last = (q, start, follow.held_from)
        follow.call_done()
        held = len(layer.recent.pages)
        assert held <= -(-window // P) + 1, (i, held)
    assert layer.recent_base > 0 and layer.head is not None and len(layer.head.pages) == 1
    assert len(layer.pages) == -(-length // P)
    q, start, held = last
    follow.held_from = held  # as the last call found it
    assert rel_err(out, follow.want(engine, kv, layer, q, start, length)) <= TOL
    # the exact rows' real pages never pass what the layer is charged for them
    exact_pages = len(layer.recent.pages) + len(layer.head.pages)
    charged = layer.nbytes - layer.paid_pages * layer.pool.page_bytes
    assert (
        exact_pages * layer.recent.pool.page_bytes
        <= charged
        == (-(-window // P) + 1 + 1) * layer.recent.pool.page_bytes
    )
    engine.release(kv).result()


def test_a_stacked_step_is_the_attends_one_by_one(engine, rng):
    """Windowed layers of several sessions (beside a plain tq4 one) in stacked fused
    steps: bit for bit what each gets attended alone, step after step."""
    h, hkv, d = 9, 3, 64
    shapes = [(3, 5), (0, 9), (4, 0)]

    def sessions():
        out = [windowed(engine, "tq4", h, hkv, d, s, w, seed=11 + i)[0] for i, (s, w) in enumerate(shapes)]
        out.append(engine.session_kv(SessionConfig(2, h, hkv, d, "tq4", 512, 99)))
        return out

    together, alone = sessions(), sessions()
    b = len(together)
    for step, m in enumerate((13, 1, 1, 5, 1)):
        q, k, v = (
            rows(rng, b * m, h, d).reshape(b, m, h, d),
            *(rows(rng, b * m, hkv, d).reshape(b, m, hkv, d) for _ in range(2)),
        )
        plan = engine.plan_stacked([s.layers[1] for s in together], q, k=k, v=v, start_pos=[None] * b)
        res = engine.worker.submit_plan(plan).result()
        assert not res.errors
        for i, s in enumerate(alone):
            one = engine.attend(s.layers[1], q[i], k=k[i], v=v[i]).result()
            assert one.length == res.lengths[i]
            np.testing.assert_array_equal(res.out[i], one.out, err_msg=f"step {step} item {i}")
            np.testing.assert_array_equal(res.lse[i], one.lse, err_msg=f"step {step} item {i}")
    for s in together + alone:
        engine.release(s).result()


def test_a_fork_is_charged_what_its_hold_took(engine, rng):
    """A fork's windowed layers are charged (``nbytes``: the codes' copied partial
    page and the exact rows) exactly what ``fork_bytes`` reserved for them before the
    fork ran (the route's hold), at a length inside a page and at one on a page."""
    h, hkv, d = 4, 2, 32
    for length in (3 * CORE_PAGE_TOKENS + 5, 2 * CORE_PAGE_TOKENS):
        src, _ = windowed(engine, "tq4", h, hkv, d, 2, 21)
        for layer in src.layers:
            k, v = rows(rng, length, hkv, d), rows(rng, length, hkv, d)
            engine.attend(layer, rows(rng, 1, h, d), k=k, v=v).result()
        dst = engine.session_kv(src.config)
        want = [layer.fork_bytes(length) for layer in dst.layers]
        engine.fork(src, dst, [length] * len(dst.layers)).result()
        assert [layer.nbytes for layer in dst.layers] == want, length
        for s in (src, dst):
            engine.release(s).result()


def test_an_attend_past_the_binding_limit_is_refused_and_changes_nothing(engine, rng):
    """A windowed attend's partials grow with its query rows and splits: one that
    would pass the adapter's binding limit is refused before the GPU sees it
    (InvalidRequest, not a failed submission), the layer exactly as it was; the
    next attend answers against the oracle."""
    from attnserve.errors import InvalidRequest

    h, hkv, d, sinks, window = 32, 8, 128, 4, 128
    # the partials' bytes: n rows x H heads x splits x (d + 2) floats; past any binding limit
    n = -(-engine.ctx.max_binding // (h * 4 * (d + 2) * 4))
    kv, layer = windowed(engine, "tq4", h, hkv, d, sinks, window, max_tokens=6001 + n)
    follow = Follow(sinks, window)
    k, v = rows(rng, 6000, hkv, d), rows(rng, 6000, hkv, d)
    follow.append(k, v)
    engine.append(layer, k, v).result()
    follow.call_done()
    before = (layer.length, list(layer.pages), list(layer.recent.pages), layer.recent_base, layer.held_from)
    with pytest.raises(InvalidRequest, match="nothing was applied"):
        engine.attend(layer, rows(rng, n, h, d), k=rows(rng, n, hkv, d), v=rows(rng, n, hkv, d)).result()
    assert (layer.length, layer.pages, layer.recent.pages, layer.recent_base, layer.held_from) == before
    q, k, v = rows(rng, 1, h, d), rows(rng, 1, hkv, d), rows(rng, 1, hkv, d)
    follow.append(k, v)
    out, length = engine.attend(layer, q, k=k, v=v).result()
    assert length == 6001 and rel_err(out, follow.want(engine, kv, layer, q, 6000, length)) <= TOL
    engine.release(kv).result()
