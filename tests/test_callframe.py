"""The layer-call frame's parser and step checks (service/attnserve/plane/callframe.c)
through its binding attnserve.plane._callframe (issue 53; docs/architecture.md,
"The call frame's parser, as built"): every status reached, frames of each dtype at
awkward sizes, the finite check against numpy's isfinite, the claim/settle
bookkeeping against a small model over many random sequences, tenancy, the table's
capacity, the heads' bytes, and buffers let go on every path.

tools/fuzz/run.sh runs this file once more against a build of the module with
ASan and UBSan: ATTNSERVE_CALLFRAME_MODULE names that build's file."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "service" / "attnserve" / "plane"


def _load():
    path = os.environ.get("ATTNSERVE_CALLFRAME_MODULE")
    if not path:
        from attnserve.plane import _callframe

        return _callframe
    spec = importlib.util.spec_from_file_location("attnserve.plane._callframe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cf = _load()
CallFrameError = cf.CallFrameError
DTYPES = ("f32", "f16", "bf16")
SIZE = {"f32": 4, "f16": 2, "bf16": 2}
STATUSES = {
    "NEED_MORE", "BAD_MAGIC", "TOO_LARGE", "UNKNOWN_STEP", "BROKEN", "LAYER_NOT_IN_STEP", "LAYER_CALLED",
    "BODY_LEN", "NOT_FINITE", "STEP_EXISTS", "TABLE_FULL", "BAD_STEP", "NOT_CLAIMED",
}  # fmt: skip
reached: set[str] = set()


def refused(status: str):
    """pytest.raises(CallFrameError) whose .status must be status."""

    class Check:
        def __enter__(self):
            self.raises = pytest.raises(CallFrameError)
            self.info = self.raises.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.raises.__exit__(*exc)
            assert self.info.value.status == status, (self.info.value.status, str(self.info.value))
            reached.add(status)
            return out

    return Check()


def wire(a: np.ndarray, dtype: str) -> bytes:
    """float32 values as the step's wire dtype (bfloat16: the top half of float32)"""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "f32":
        return a.astype("<f4").tobytes()
    if dtype == "f16":
        return a.astype("<f2").tobytes()
    return (a.view("<u4") >> 16).astype("<u2").tobytes()


def finite_of(raw: bytes, dtype: str) -> np.ndarray:
    """numpy's isfinite over wire bytes"""
    if dtype == "f32":
        return np.isfinite(np.frombuffer(raw, "<f4"))
    if dtype == "f16":
        return np.isfinite(np.frombuffer(raw, "<f2"))
    return np.isfinite((np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4"))


def test_built_from_this_checkout():
    # a module built from other sources would test other code: rebuild it
    for name, digest in cf.SOURCES.items():
        assert hashlib.sha256((SOURCE / name).read_bytes()).hexdigest() == digest, (
            f"_callframe was built from an older {name}: python setup.py build_ext --inplace (or pip install -e .)"
        )
    assert cf.SOURCE_DIGEST == hashlib.sha256("".join(cf.SOURCES.values()).encode()).hexdigest()
    assert (cf.HEAD_BYTES, cf.REPLY_HEAD_BYTES, cf.MAX_LAYERS) == (20, 16, 4096)
    assert issubclass(CallFrameError, ValueError)


def test_heads_bytes():
    assert cf.reply_head(1, 0x200, 0xFFFFFFFE) == b"ATR1" + struct.pack("<III", 1, 0x200, 0xFFFFFFFE)
    assert cf.call_head(7, 4095, 3, 12) == b"ATC1" + struct.pack("<IIII", 7, 4095, 3, 12)
    assert len(cf.reply_head(0, 0, 0)) == cf.REPLY_HEAD_BYTES
    for bad in ((-1, 0, 0), (0, 2**32, 0)):
        with pytest.raises(OverflowError):
            cf.reply_head(*bad)
    with pytest.raises(TypeError):
        cf.reply_head(1.0, 0, 0)


def test_parse_head():
    head = cf.call_head(0x01020304, 9, 0xFFFFFFFF, 77)
    for buffer in (head, bytearray(head), memoryview(head), np.frombuffer(head, np.uint8), head + b"body"):
        assert cf.parse_head(buffer) == (0x01020304, 9, 0xFFFFFFFF, 77)
    assert cf.parse_head(head, 77) == (0x01020304, 9, 0xFFFFFFFF, 77)
    with refused("TOO_LARGE"):
        cf.parse_head(head, max_body=76)
    with refused("TOO_LARGE"):
        cf.parse_head(cf.call_head(1, 0, 0, 0xFFFFFFFF), 1 << 30)
    for n in range(cf.HEAD_BYTES):
        with refused("NEED_MORE"):
            cf.parse_head(head[:n])
    # a wrong magic is refused on as many of its bytes as there are
    for bad in (b"ATF1" + head[4:], b"X", b"ATC2", b"atc1" + head[4:]):
        with refused("BAD_MAGIC"):
            cf.parse_head(bad)


def test_open_close_and_capacity():
    with pytest.raises(ValueError):
        cf.StepTable(0)
    with pytest.raises(ValueError):
        cf.StepTable(2**20 + 1)
    t = cf.StepTable(3)
    assert (len(t), t.capacity) == (0, 3)
    for step in (1, 2, 2**32 - 1):
        t.open(step, 1, [0], 4, 0, 0, "f32", False)
    with refused("STEP_EXISTS"):
        t.open(2, 1, [0], 4, 0, 0, "f32", False)
    with refused("TABLE_FULL"):
        t.open(4, 1, [0], 4, 0, 0, "f32", False)
    t.close(2)
    with refused("UNKNOWN_STEP"):
        t.close(2)
    t.open(4, 1, [0], 4, 0, 0, "f32", False)
    assert len(t) == 3
    with refused("UNKNOWN_STEP"):
        t.info(2)
    # churn: ids come and go, the table stays right
    rng = np.random.default_rng(0)
    t = cf.StepTable(16)
    open_ = set()
    for _ in range(3000):
        step = int(rng.integers(1, 40))
        if step in open_:
            t.close(step)
            open_.discard(step)
        elif len(open_) < 16:
            t.open(step, step, [step % 7], 4, 0, 0, "f32", False)
            open_.add(step)
        assert len(t) == len(open_)
    assert all(t.info(s)["owner"] == s for s in open_)


@pytest.mark.parametrize(
    "args",
    [
        (0, 1, [0], 4, 0, 0, "f32", False),  # id 0: handles are positive
        (1, 1, [], 4, 0, 0, "f32", False),
        (1, 1, [4096], 4, 0, 0, "f32", False),
        (1, 1, [3, 3], 4, 0, 0, "f32", False),
        (1, 1, [0], 0, 0, 0, "f32", False),  # no q
        (1, 1, [0], 6, 0, 0, "f32", False),  # 1.5 elements
        (1, 1, [0], 4, 4, 8, "f32", False),  # k and v differ
        (1, 1, [0], 2, 1, 1, "bf16", False),
        (1, 1, [0], 2**32 - 4, 4, 4, "f32", False),  # no frame carries it
        (1, 1, list(range(4097)), 4, 0, 0, "f32", False),
    ],
)
def test_a_bad_step_is_refused(args):
    t = cf.StepTable(2)
    with refused("BAD_STEP"):
        t.open(*args)
    assert len(t) == 0


def test_open_argument_errors():
    t = cf.StepTable(2)
    with pytest.raises(ValueError, match="dtype"):
        t.open(1, 1, [0], 4, 0, 0, "f64", False)
    with pytest.raises(OverflowError):
        t.open(1, 1, [-1], 4, 0, 0, "f32", False)
    with pytest.raises(OverflowError):
        t.open(2**32, 1, [0], 4, 0, 0, "f32", False)
    with pytest.raises(TypeError):
        t.open(1, 1, 5, 4, 0, 0, "f32", False)
    t.open(1, 1, range(4096), 2**32 - 12, 4, 4, "<f4", True)  # the limits themselves
    info = t.info(1)
    assert info["layers"] == list(range(4096)) and info["q_bytes"] == 2**32 - 12 and info["dtype"] == "f32"


def frame(rng, dtype: str, b: int, queries: int, hq: int, rows: int, hkv: int, d: int):
    q = rng.standard_normal((b, queries, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, rows, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, rows, hkv, d)).astype(np.float32)
    return wire(q, dtype), wire(k, dtype), wire(v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 0, 1, 1), (3, 1, 5, 1, 1, 7), (2, 3, 7, 3, 1, 9), (5, 2, 6, 0, 3, 13)])
def test_valid_frames(dtype, shape):
    b, queries, hq, rows, hkv, d = shape
    rng = np.random.default_rng(sum(shape))
    qb, kb, vb = frame(rng, dtype, *shape)
    assert (len(kb) == 0) == (rows == 0)
    t = cf.StepTable(4)
    layers = [4095, 0, 17]
    t.open(9, 3, layers, len(qb), len(kb), len(vb), dtype, True)
    for i, layer in enumerate(layers):
        whole = bytearray(cf.call_head(9, layer, i, len(qb) + len(kb) + len(vb)) + qb + kb + vb)
        head = cf.parse_head(whole)
        body = memoryview(whole)[cf.HEAD_BYTES :]
        offsets = t.check(3, head, body)
        assert offsets == (0, len(qb), len(qb) + len(kb))
        assert t.check(3, bytes(whole[: cf.HEAD_BYTES]), body) == offsets
        assert bytes(body[offsets[0] : offsets[1]]) == qb and bytes(body[offsets[2] :]) == vb
        assert t.claim(9, layer) == 0
        assert t.settle(9, layer, b, 0) == (1 if i == 2 else 0)
        del body
        whole.extend(b"x")  # no view of it is held any more


def test_every_check_status():
    t = cf.StepTable(4)
    qb, kb, vb = bytes(8), bytes(4), bytes(4)
    body = qb + kb + vb
    t.open(5, 1, [0, 1, 2], 8, 4, 4, "f32", True)
    t.open(6, 2, [0], 8, 4, 4, "f32", True)
    assert t.check(1, (5, 0, 0, 16), body) == (0, 8, 12)
    with refused("UNKNOWN_STEP"):
        t.check(1, (7, 0, 0, 16), body)
    with refused("UNKNOWN_STEP"):  # another tenant's step
        t.check(1, (6, 0, 0, 16), body)
    with refused("UNKNOWN_STEP"):
        t.check(2, (5, 0, 0, 16), body)
    with refused("LAYER_NOT_IN_STEP"):
        t.check(1, (5, 3, 0, 16), body)
    with refused("LAYER_NOT_IN_STEP"):
        t.check(1, (5, 2**32 - 1, 0, 16), body)
    with refused("BODY_LEN"):
        t.check(1, (5, 0, 0, 15), body)
    with refused("BODY_LEN"):
        t.check(1, (5, 0, 0, 16), body[:-1])
    with refused("BODY_LEN"):
        t.check(1, (5, 0, 0, 17), body + b"\0")
    with refused("NOT_FINITE") as e:
        t.check(1, (5, 0, 0, 16), qb + struct.pack("<f", float("inf")) + vb)
    assert (e.value.array, e.value.index) == ("k", 0)
    with refused("NEED_MORE"):
        t.check(1, b"ATC1", body)
    with refused("BAD_MAGIC"):
        t.check(1, b"ATF1" + bytes(16), body)
    t.claim(5, 1)
    with refused("LAYER_CALLED"):  # in flight
        t.check(1, (5, 1, 0, 16), body)
    with refused("LAYER_CALLED"):
        t.claim(5, 1)
    t.settle(5, 1, 1, 0)
    with refused("LAYER_CALLED"):  # applied this token
        t.check(1, (5, 1, 0, 16), body)
    with refused("NOT_CLAIMED"):
        t.settle(5, 1, 1, 0)
    with refused("NOT_CLAIMED"):
        t.settle(5, 2, 1, 0)
    with refused("LAYER_NOT_IN_STEP"):
        t.claim(5, 9)
    t.claim(5, 0)
    t.settle(5, 0, 3, 1)  # applied to some items only: broken
    info = t.info(5)
    assert (info["broken"], info["broken_layer"], info["broken_token"]) == (True, 0, 0)
    with refused("BROKEN") as e:
        t.check(1, (5, 2, 0, 16), body)
    assert "layer 0 of token 0" in str(e.value)
    with refused("BROKEN"):
        t.claim(5, 2)
    with refused("UNKNOWN_STEP"):
        t.claim(8, 0)
    with refused("UNKNOWN_STEP"):
        t.settle(8, 0, 1, 0)
    t.close(5)
    with refused("UNKNOWN_STEP"):
        t.check(1, (5, 2, 0, 16), body)


def test_argument_errors_and_buffers_let_go():
    t = cf.StepTable(2)
    t.open(1, 1, [0], 4, 0, 0, "f32", True)
    with pytest.raises(TypeError):
        t.check(1, (1, 0, 0), b"1234")
    with pytest.raises(OverflowError):
        t.check(1, (1, 0, 0, -4), b"1234")
    with pytest.raises(TypeError):
        t.check(1, (1, 0, 0, 4), "1234")
    with pytest.raises((BufferError, TypeError, ValueError)):  # not contiguous
        t.check(1, (1, 0, 0, 4), np.zeros(8, np.uint8)[::2])
    # every path lets go of the buffers it took: a bytearray with a view held
    # cannot be resized
    head = bytearray(cf.call_head(1, 0, 0, 4))
    for body in (bytearray(b"\0\0\0\0"), bytearray(b"\0\0\x80\x7f"), bytearray(b"\0\0\0")):
        try:
            t.check(1, head, body)
        except CallFrameError:
            pass
        body.extend(b"x")
        head.extend(b"x")
        del head[-1]
    short = bytearray(b"ATC1")
    with refused("NEED_MORE"):
        cf.parse_head(short)
    short.extend(b"x")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_check_matches_numpy(dtype, seed):
    rng = np.random.default_rng(1000 + seed)
    t = cf.StepTable(64)
    for trial in range(40):
        n_q, n_kv = int(rng.integers(1, 700)), int(rng.integers(0, 300))
        arrays = []
        for n in (n_q, n_kv, n_kv):
            if trial % 4 == 3:  # random bit patterns: NaNs, infinities, subnormals
                raw = rng.integers(0, 256, n * SIZE[dtype], dtype=np.uint8).tobytes()
            else:
                a = rng.standard_normal(n).astype(np.float32) * 1e3
                for _ in range(int(rng.integers(0, 3))):
                    if n and rng.random() < 0.3:
                        a[rng.integers(0, n)] = rng.choice([np.nan, np.inf, -np.inf])
                raw = wire(a, dtype)
            arrays.append(raw)
        qb, kb, vb = arrays
        step = trial + 1
        t.open(step, 0, [trial], len(qb), len(kb), len(vb), dtype, True)
        want = None
        for name, raw in zip("qkv", arrays):
            bad = np.flatnonzero(~finite_of(raw, dtype))
            if bad.size:
                want = (name, int(bad[0]))
                break
        head = (step, trial, 0, len(qb) + len(kb) + len(vb))
        if want is None:
            assert t.check(0, head, qb + kb + vb) == (0, len(qb), len(qb) + len(kb))
        else:
            with refused("NOT_FINITE") as e:
                t.check(0, head, qb + kb + vb)
            assert (e.value.array, e.value.index) == want
        # unchecked: the same bytes pass
        t.close(step)
        t.open(step, 0, [trial], len(qb), len(kb), len(vb), dtype, False)
        assert t.check(0, head, qb + kb + vb)[0] == 0
        t.close(step)


class Model:
    """The step's bookkeeping as the spec says it (docs/architecture.md)."""

    def __init__(self, layers: list[int]):
        self.layers = set(layers)
        self.in_flight: set[int] = set()
        self.applied: set[int] = set()
        self.token = 0
        self.broken: tuple[int, int] | None = None

    def claim(self, layer: int) -> str:
        if self.broken:
            return "BROKEN"
        if layer not in self.layers:
            return "LAYER_NOT_IN_STEP"
        if layer in self.in_flight or layer in self.applied:
            return "LAYER_CALLED"
        self.in_flight.add(layer)
        return "OK"

    def settle(self, layer: int, applied: int, failed: int) -> str:
        if layer not in self.in_flight:
            return "NOT_CLAIMED"
        self.in_flight.discard(layer)
        if applied == 0:
            return "OK"
        self.applied.add(layer)
        if failed and self.broken is None:
            self.broken = (layer, self.token)
        if self.applied == self.layers:
            self.token += 1
            self.applied.clear()
        return "OK"


@pytest.mark.parametrize("seed", range(60))
def test_bookkeeping_matches_the_model(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    layers = sorted({int(x) for x in rng.choice(4096, n, replace=False)})
    t = cf.StepTable(1)
    t.open(3, 1, layers, 4, 4, 4, "f32", False)
    model = Model(layers)
    last_token = 0
    for _ in range(300):
        # mostly the step's layers, sometimes others
        layer = int(rng.choice(layers)) if rng.random() < 0.9 else int(rng.integers(0, 5000))
        what = rng.random()
        if what < 0.45:
            want, op = model.claim(layer), lambda: t.claim(3, layer)
        elif what < 0.9:
            applied = int(rng.choice([0, 0, 1, 2, 2**40]))
            failed = int(rng.choice([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]))
            want, op = model.settle(layer, applied, failed), lambda: t.settle(3, layer, applied, failed)
        else:  # a check changes nothing; its answer follows the state
            want = (
                "BROKEN"
                if model.broken
                else "LAYER_NOT_IN_STEP"
                if layer not in model.layers
                else "LAYER_CALLED"
                if layer in model.in_flight | model.applied
                else "OK"
            )
            op = lambda: t.check(1, (3, layer, 0, 12), bytes(12))
        if want == "OK":
            op()
        else:
            with refused(want):
                op()
        info = t.info(3)
        assert info["token"] == model.token >= last_token
        last_token = info["token"]
        assert info["in_flight"] == sorted(model.in_flight)
        assert info["applied"] == sorted(model.applied)
        assert info["broken"] == (model.broken is not None)
        if model.broken:
            assert (info["broken_layer"], info["broken_token"]) == model.broken
    assert model.token > 0 or model.broken or len(layers) > 3


def test_zz_every_status_reached():
    # runs last in this file (pytest keeps the file's order): the tests above reach
    # every status but OK
    if len(reached) < len(STATUSES):
        pytest.skip("run with the whole file")
    assert reached == STATUSES


def test_the_clients_heads_are_the_parsers():
    """The client builds call frames and reads call replies with its own structs
    (attnserve_client.framing, pure Python): they agree with this module's heads."""
    from attnserve_client import framing

    assert framing.CALL_HEAD.size == cf.HEAD_BYTES and framing.REPLY_HEAD.size == cf.REPLY_HEAD_BYTES
    for step, layer, seq, n in ((1, 0, 1, 0), (7, 3, 99, 1234), (2**32 - 1, 4095, 2**32 - 1, 2**31)):
        head = framing.CALL_HEAD.pack(framing.CALL_MAGIC, step, layer, seq, n)
        assert head == cf.call_head(step, layer, seq, n)
        assert cf.parse_head(head, 2**32 - 1) == (step, layer, seq, n)
        assert framing.REPLY_HEAD.pack(framing.REPLY_MAGIC, seq, 200, n) == cf.reply_head(seq, 200, n)
