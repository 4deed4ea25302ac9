"""Open steps (``open_step``) against the live server, on every transport (HTTP,
the WebSocket stream, frames, shared memory) with the sync and the async client:
a step's layer calls answer bit for bit what ``attend_stacked`` answers on twin
sessions with the same arrays and options (awkward sizes: 3 sessions, 6 query /
2 KV heads of 40, a prefill of 5 rows then decoding rows of 1 over several
tokens; float32, bfloat16, float16; ``return_lse``; torch tensors); each of the
step's problems raises its exception; and a call that does not fit the step is
refused by the client before anything is sent.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import numpy as np
import pytest
import torch

import attnserve_client as ac
from attnserve_client import wire

H, KV, D, LAYERS = 6, 2, 40, 2
B = 3
DRIVERS = [(t, m) for t in ("http", "websocket", "frames", "shm") for m in ("sync", "async")]


@pytest.fixture(scope="module")
def server(start_live_server, tmp_path_factory):
    server = start_live_server(frames_port=0, shm_socket=str(tmp_path_factory.mktemp("shm") / "attnserve.sock"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ref(server):
    """The sync HTTP client the references (attend_stacked on twins) go through."""
    with ac.Client(server.url) as c:
        yield c


class Sync:
    """Blocking calls of an async object on one loop (its steps wrapped alike)."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop):
        self.target, self._loop = target, loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            got = self._loop.run_until_complete(attr(*args, **kwargs))
            return Sync(got, self._loop) if isinstance(got, (ac.AsyncStep, ac.AsyncStreamStep)) else got

        return call

    def __enter__(self) -> Sync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Steps:
    """Where a test opens its steps: a client (http) or a stream of one, sync or async."""

    def __init__(self, url: str, transport: str, mode: str):
        self.transport, self.mode = transport, mode
        self.loop = asyncio.new_event_loop() if mode == "async" else None
        if mode == "sync":
            self.client: Any = ac.Client(url)
            self.opener = self.client if transport == "http" else self.client.stream(transport=transport)
        else:
            self.client = ac.AsyncClient(url)

            async def stream() -> Any:
                return await self.client.stream(transport=transport)

            self.opener = self.client if transport == "http" else self.run(stream())

    def run(self, coro: Any) -> Any:
        assert self.loop is not None
        return self.loop.run_until_complete(coro)

    def open(self, sessions: Any, **options: Any) -> Any:
        got = self.opener.open_step(sessions, **options)
        return got if self.loop is None else Sync(self.run(got), self.loop)

    def close_stream(self) -> None:
        if self.opener is not self.client:
            got = self.opener.close()
            if self.loop is not None:
                self.run(got)

    def close(self) -> None:
        self.close_stream()
        got = self.client.close()
        if self.loop is not None:
            self.run(got)
            self.loop.close()


def _driven(server: Any, driver: tuple[str, str]) -> Any:
    s = Steps(server.url, *driver)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(params=DRIVERS, ids=[f"{t}-{m}" for t, m in DRIVERS])
def steps(request, server):
    yield from _driven(server, request.param)


gen = np.random.default_rng(53)


def rand(*shape: int, dtype: str = "<f4") -> np.ndarray:
    a = gen.standard_normal(shape).astype(np.float32)
    return a if dtype == "<f4" else (a.astype(np.float16) if dtype == "<f2" else wire.to_bfloat16(a))


def make(ref, n: int = B, **spec: Any) -> list[Any]:
    return [
        ref.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, **spec) for _ in range(n)
    ]


def drop(ref, *groups: list[Any]) -> None:
    for group in groups:
        for s in group:
            s.delete()


def same(got: Any, want: Any) -> None:
    """Bit for bit: the arrays (or both parts of an Attention), and their dtypes."""
    if isinstance(want, ac.Attention):
        assert isinstance(got, ac.Attention)
        same(got.out, want.out)
        same(got.lse, want.lse)
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


# -- answers: bit-identical to attend_stacked --------------------------------------


@pytest.mark.parametrize("dtype", ["<f4", "bfloat16", "<f2"])
def test_a_steps_calls_are_attend_stacked_bit_for_bit(steps, ref, dtype):
    a, twins = make(ref), make(ref)
    try:
        # the prefill: 5 rows a session, every layer
        with steps.open(a, rows=5, dtype=dtype) as step:
            assert step.layers == list(range(LAYERS)) and step.rows == 5 and step.queries == 5
            assert step.dtype == dtype and step.token == 0 and step.session_ids == [s.session_id for s in a]
            for layer in range(LAYERS):
                q, k, v = rand(B, 5, H, D, dtype=dtype), rand(B, 5, KV, D, dtype=dtype), rand(B, 5, KV, D, dtype=dtype)
                same(step.call(layer, q, k, v), ref.attend_stacked(twins, layer, q, k, v))
            assert step.token == 1
        assert [s.lengths for s in a] == [(5, 5)] * B  # the sessions' tracked lengths follow the step
        # decoding: a row a session, several tokens; [B, 1, H, d] and [B, H, d] alike
        with steps.open(a, dtype=dtype) as step:
            assert step.rows == 1 and step.queries == 1
            for token in range(4):
                for layer in reversed(range(LAYERS)):  # any order within a token
                    q, k, v = (
                        rand(B, 1, H, D, dtype=dtype),
                        rand(B, 1, KV, D, dtype=dtype),
                        rand(B, 1, KV, D, dtype=dtype),
                    )
                    if token % 2:
                        q, k, v = q[:, 0], k[:, 0], v[:, 0]
                    got = step.call(layer, q, k, v)
                    assert got.shape == q.shape
                    same(got, ref.attend_stacked(twins, layer, q, k, v))
                assert step.token == token + 1
        assert [s.lengths for s in a] == [(9, 9)] * B
    finally:
        drop(ref, a, twins)


def test_options_fixed_at_the_open(steps, ref):
    """return_lse, out_dtype, scale, causal=False, and a step over some layers that
    appends nothing (rows=0) with more query rows than a call appends."""
    a, twins = make(ref), make(ref)
    try:
        opts = dict(return_lse=True, out_dtype="<f2", scale=0.3)
        with steps.open(a, rows=3, **opts) as step:
            for layer in range(LAYERS):
                q, k, v = rand(B, 3, H, D), rand(B, 3, KV, D), rand(B, 3, KV, D)
                got = step.call(layer, q, k, v)
                assert isinstance(got, ac.Attention) and got.out.dtype == np.float16
                same(got, ref.attend_stacked(twins, layer, q, k, v, **opts))
        with steps.open(a, rows=0, queries=2, layers=[1], causal=False) as step:
            assert step.layers == [1] and step.rows == 0 and step.queries == 2
            for token in range(2):
                q = rand(B, 2, H, D)
                same(step.call(1, q), ref.attend_stacked(twins, 1, q, causal=False))
                assert step.token == token + 1
        assert [s.lengths for s in a] == [(3, 3)] * B
    finally:
        drop(ref, a, twins)


def test_tensors_in_tensors_out(steps, ref):
    a, twins = make(ref), make(ref)
    try:
        with steps.open(a, dtype=torch.bfloat16) as step:
            for layer in range(LAYERS):
                # a transposed view (not contiguous): what an engine holds
                q = torch.randn(B, H, 1, D).to(torch.bfloat16).transpose(1, 2)
                k, v = (torch.randn(B, KV, 1, D).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
                got = step.call(layer, q, k, v)
                same(got, ref.attend_stacked(twins, layer, q.contiguous(), k.contiguous(), v.contiguous()))
                assert got.dtype == torch.bfloat16 and got.shape == q.shape
    finally:
        drop(ref, a, twins)


def test_sync_stream_calls_pipeline(server, ref):
    a, twins = make(ref), make(ref)
    try:
        with ac.Client(server.url) as c, c.stream(transport="frames") as stream:
            with stream.open_step([s.session_id for s in a]) as step:  # ids will do too
                arrays = [[rand(B, 1, H, D), rand(B, 1, KV, D), rand(B, 1, KV, D)] for _ in range(3 * LAYERS)]
                got = []
                for token in range(3):  # a token's layers in flight at once (a layer's calls: one at a time)
                    calls = range(token * LAYERS, (token + 1) * LAYERS)
                    futures = [step.submit_call(i % LAYERS, *arrays[i]) for i in calls]
                    got += [f.result() for f in futures]
                    assert step.token == token + 1
        for i, arrs in enumerate(arrays):
            same(got[i], ref.attend_stacked(twins, i % LAYERS, *arrs))
    finally:
        drop(ref, a, twins)


def test_http_step_info(ref):
    a = make(ref)
    try:
        with ref.open_step(a) as step:
            step.call(0, rand(B, 1, H, D), rand(B, 1, KV, D), rand(B, 1, KV, D))
            info = step.info()
            assert info["step"] == step.id and info["token"] == 0 == step.token and info["broken"] is None
            assert info["lengths"] == [[1, 0]] * B
            step.call(1, rand(B, 1, H, D), rand(B, 1, KV, D), rand(B, 1, KV, D))
            assert step.info()["token"] == 1 == step.token
        step.close()  # closed already: nothing to do
    finally:
        drop(ref, a)


# -- the step's problems -------------------------------------------------------------


def test_a_session_in_a_step_is_the_steps(steps, ref):
    a = make(ref, 2)
    try:
        q, k, v = rand(2, 1, H, D), rand(2, 1, KV, D), rand(2, 1, KV, D)
        with steps.open(a) as step:
            with pytest.raises(ac.BatchError) as caught:  # a batch's sessions: item by item
                ref.attend_stacked(a, 0, q, k, v)
            assert all(isinstance(e, ac.SessionInStep) for e in caught.value.results)
            with pytest.raises(ac.SessionInStep) as refused:
                a[0].attend(0, q[0])
            assert refused.value.status == 409 and str(step.id) in refused.value.detail
            with pytest.raises(ac.SessionInStep):
                a[0].append(0, k[0], v[0])
            with pytest.raises(ac.SessionInStep):
                steps.open(a[1:])
            with pytest.raises(ac.SessionInStep):
                a[1].delete()
            a[0].fork().delete()  # a fork is allowed
            step.call(0, q, k, v)
        ref.attend_stacked(a, 0, q, k, v)  # closed: the sessions are free again
    finally:
        drop(ref, a)


def test_a_layer_is_called_once_a_token(steps, ref):
    a = make(ref, 2)
    try:
        with steps.open(a) as step:
            q, k, v = rand(2, 1, H, D), rand(2, 1, KV, D), rand(2, 1, KV, D)
            step.call(0, q, k, v)
            with pytest.raises(ac.StepLayerCalled) as caught:
                step.call(0, q, k, v)
            assert caught.value.status == 409 and "layer 0" in caught.value.detail
            assert step.token == 0 and step.called == {0}
            step.call(1, q, k, v)
            assert step.token == 1 and step.called == set()
        assert [s.lengths for s in a] == [(1, 1)] * 2
    finally:
        drop(ref, a)


def test_a_closed_step(steps, ref):
    a = make(ref, 2)
    try:
        step = steps.open(a)
        step.close()
        assert step.closed
        step.close()  # again: no error
        q = rand(2, 1, H, D)
        with pytest.raises(ac.StepNotFound) as caught:  # refused before sending
            step.call(0, q, q[:, :, :KV], q[:, :, :KV])
        assert isinstance(caught.value, ac.InvalidInput) and caught.value.status is None
        state = step.target._state if isinstance(step, Sync) else step._state
        state.closed = False  # as if this client did not know: the server's answer
        with pytest.raises(ac.StepNotFound) as caught:
            step.call(0, q, q[:, :, :KV], q[:, :, :KV])
        assert caught.value.status == 404 and not isinstance(caught.value, ac.InvalidInput)
    finally:
        drop(ref, a)


def test_a_call_that_applies_in_part_breaks_the_step(steps, ref):
    small = ref.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, max_tokens=8)
    big = make(ref, 1)[0]
    try:
        with steps.open([small, big], rows=5, layers=[0]) as step:
            q, k, v = rand(2, 5, H, D), rand(2, 5, KV, D), rand(2, 5, KV, D)
            step.call(0, q, k, v)
            with pytest.raises(ac.BatchError) as caught:
                step.call(0, q, k, v)  # 10 rows of small's 8: item 0 fails, item 1 applies
            assert list(caught.value.errors) == [0] and isinstance(caught.value.errors[0], ac.CapacityExceeded)
            assert step.broken is not None and step.token == 2
            with pytest.raises(ac.StepBroken) as broken:
                step.call(0, q, k, v)
            assert broken.value.status == 409
        assert small.lengths[0] == 5 and big.lengths[0] == 10
    finally:
        drop(ref, [small, big])


STREAM_DRIVERS = [(t, m) for t, m in DRIVERS if t != "http"]  # a step opened over HTTP is bound to no connection


@pytest.fixture(params=STREAM_DRIVERS, ids=[f"{t}-{m}" for t, m in STREAM_DRIVERS])
def stream_steps(request, server):
    yield from _driven(server, request.param)


def test_a_streams_steps_close_with_it(stream_steps, ref):
    steps = stream_steps
    a = make(ref, 2)
    try:
        step = steps.open(a)
        steps.close_stream()
        step.close()  # the connection closed it: no error
        ref.attend_stacked(a, 0, rand(2, 1, H, D), rand(2, 1, KV, D), rand(2, 1, KV, D))
    finally:
        drop(ref, a)


# -- the client's checks, before anything is sent -------------------------------------


def refused_unsent(monkeypatch, call: Any, match: str) -> None:
    packed: list[Any] = []
    packb = wire.packb
    monkeypatch.setattr(wire, "packb", lambda doc, *a, **kw: packed.append(doc) or packb(doc, *a, **kw))
    with pytest.raises(ac.InvalidRequest, match=match) as caught:
        call()
    monkeypatch.setattr(wire, "packb", packb)
    assert isinstance(caught.value, ac.InvalidInput) and caught.value.status is None
    assert not packed, packed


def test_a_call_that_does_not_fit_the_step_is_never_sent(steps, ref, monkeypatch):
    a = make(ref)
    try:
        with steps.open(a, rows=2, layers=[1]) as step:
            q, k, v = rand(B, 2, H, D), rand(B, 2, KV, D), rand(B, 2, KV, D)
            cases = [
                (lambda: step.call(0, q, k, v), r"layer 0 is not one of this step's layers \[1\]"),
                (lambda: step.call(1, q.astype(np.float16), k, v), "expected this step's dtype <f4, got <f2"),
                (lambda: step.call(1, q[:2], k[:2], v[:2]), r"q: expected shape \[3, 2, 6, 40\]"),
                (lambda: step.call(1, q, k[:, :1], v[:, :1]), r"k: expected shape \[3, 2, 2, 40\]"),
                (lambda: step.call(1, q[:, :, :3], k, v), r"q: expected shape \[3, 2, 6, 40\]"),
                (
                    lambda: step.call(1, q[:, 0], k, v),
                    r"q: expected shape \[3, 2, 6, 40\] .*queries 2.*, got \[3, 6, 40\]",
                ),
                (lambda: step.call(1, q), "k, v: this step appends 2 rows a call"),
                (lambda: step.call(1, np.full_like(q, np.nan), k, v), "finite"),
            ]
            for call, match in cases:
                refused_unsent(monkeypatch, call, match)
            step.call(1, q, k, v)  # the step is as it was
        with steps.open(a, rows=0, layers=[0]) as step:
            refused_unsent(monkeypatch, lambda: step.call(0, q, k, v), r"this step appends no rows")
    finally:
        drop(ref, a)


def test_openings_refused_before_sending(steps, ref, monkeypatch):
    a = make(ref, 2)
    try:
        for options, match in [
            ({}, "distinct sessions"),
            ({"rows": -1}, "rows: expected an int >= 0"),
            ({"queries": 0}, "queries: expected an int >= 1"),
            ({"layers": [0, 0]}, "distinct layer indexes"),
            ({"layers": []}, "layers: expected a non-empty sequence"),
            ({"dtype": "float64"}, "dtype: expected one of"),
        ]:
            sessions = [a[0], a[0]] if not options else a
            refused_unsent(monkeypatch, lambda: steps.open(sessions, **options), match)
    finally:
        drop(ref, a)


def test_steps_need_one_server(server):
    with ac.Client(server.url) as c:
        sharded = ac.ShardedSession.create([c], num_qo_heads=H, num_kv_heads=KV, head_dim=D)
        try:
            with pytest.raises(ac.InvalidInput, match="ShardedSession"):
                c.open_step([sharded])
        finally:
            sharded.delete()


@pytest.mark.parametrize("transport", ["stream", "http"])
def test_the_engine_example_decodes_through_a_step(server, capsys, transport):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "engine_batch.py"
    spec = importlib.util.spec_from_file_location("engine_batch", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--sequences", "3", "--layers", "2", "--heads", "6", "--kv-heads", "2", "--head-dim", "40"]
    args += ["--prompt", "7", "--steps", "3", "--open-step", "--url", server.url, "--transport", transport]
    assert example.main(args) == 0
    out = capsys.readouterr().out
    assert "decoding through an open step" in out and "cache lengths [10, 7, 4]" in out and out.rstrip().endswith("ok")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_frames_send_layer_calls_as_call_frames(server, ref, mode, monkeypatch):
    """Over the frame transport a step's layer calls go as call frames (no
    MessagePack document is sent for them) and their call replies give what the
    documents' answers give; the sessions' tracked lengths follow."""
    sent_ops: list[str] = []
    for channel in (ac._streams._FrameChannel, ac._streams._AsyncFrameChannel):
        original = channel.send

        def spy(self: Any, doc: dict[str, Any], _original: Any = original) -> Any:
            sent_ops.append(doc.get("op"))
            return _original(self, doc)

        monkeypatch.setattr(channel, "send", spy)
    steps = Steps(server.url, "frames", mode)
    a, twins = make(ref), make(ref)
    try:
        with steps.open(a, rows=1, return_lse=True) as step:
            for _ in range(2):
                for layer in range(LAYERS):
                    q, k, v = rand(B, 1, H, D), rand(B, 1, KV, D), rand(B, 1, KV, D)
                    same(step.call(layer, q, k, v), ref.attend_stacked(twins, layer, q, k, v, return_lse=True))
            assert step.token == 2
        assert "step_call" not in sent_ops and "step_open" in sent_ops
        assert [s.lengths for s in a] == [(2, 2)] * B
    finally:
        steps.close()
        drop(ref, a, twins)


# -- out=: the answer into the caller's array -------------------------------------------


def _received_in_place(monkeypatch) -> list[bool]:
    """Per call with ``out=``, whether its answer was in the destination already when
    decoded (read off the socket or copied from the region into it), not copied there."""
    seen: list[bool] = []
    fill = ac._steps.Destination.fill

    def spy(self: Any, out: np.ndarray) -> Any:
        seen.append(out.ctypes.data == self.host.ctypes.data)
        return fill(self, out)

    monkeypatch.setattr(ac._steps.Destination, "fill", spy)
    return seen


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("dtype", ["<f4", "bfloat16", "<f2"])
def test_out_answers_into_the_callers_array_bit_for_bit(steps, ref, dtype, return_lse, monkeypatch):
    """A call with ``out=`` answers ``out`` itself, holding bit for bit what the call
    answers without it (attend_stacked on twins); over frames and shared memory the
    reply lands in it (no copy after decoding); a prefill and decoding, [B, 1, H, d]
    and [B, H, d], numpy arrays and CPU tensors alike."""
    seen = _received_in_place(monkeypatch)
    a, twins = make(ref), make(ref)
    opts = {"return_lse": True} if return_lse else {}
    try:
        with steps.open(a, rows=3, dtype=dtype, **opts) as step:
            for layer in range(LAYERS):
                q, k, v = rand(B, 3, H, D, dtype=dtype), rand(B, 3, KV, D, dtype=dtype), rand(B, 3, KV, D, dtype=dtype)
                out = np.full_like(q, 7)
                got = step.call(layer, q, k, v, out=out)
                want = ref.attend_stacked(twins, layer, q, k, v, **opts)
                if return_lse:
                    assert got.out is out
                else:
                    assert got is out
                same(got, want)
        with steps.open(a, dtype=dtype, **opts) as step:
            out3 = np.empty((B, H, D), wire.DTYPES[dtype])  # one destination for every call
            for token in range(3):
                for layer in range(LAYERS):
                    q, k, v = (
                        rand(B, 1, H, D, dtype=dtype),
                        rand(B, 1, KV, D, dtype=dtype),
                        rand(B, 1, KV, D, dtype=dtype),
                    )
                    if token == 1:  # CPU tensors: the answer a tensor, the destination's own
                        tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16"
                                      else torch.from_numpy(x) for x in (q, k, v))  # fmt: skip
                        tout = torch.empty(tq.shape, dtype=tq.dtype)
                        got = step.call(layer, tq, tk, tv, out=tout)
                        assert (got.out if return_lse else got) is tout
                        same(got, ref.attend_stacked(twins, layer, tq, tk, tv, **opts))
                        continue
                    if token == 2:
                        q, k, v = q[:, 0], k[:, 0], v[:, 0]
                        out = out3
                    else:
                        out = np.empty_like(q)
                    got = step.call(layer, q, k, v, out=out)
                    assert (got.out if return_lse else got) is out
                    same(got, ref.attend_stacked(twins, layer, q, k, v, **opts))
            assert step.token == 3
        assert [s.lengths for s in a] == [(6, 6)] * B
    finally:
        drop(ref, a, twins)
    assert len(seen) == LAYERS * 4
    if steps.transport in ("frames", "shm"):
        assert all(seen), seen
    else:  # decoded from the answer's document, then copied into out
        assert not any(seen), seen


def test_pipelined_calls_each_answer_into_their_own_out(server, ref):
    a, twins = make(ref), make(ref)
    try:
        for transport in ("frames", "shm"):
            with ac.Client(server.url) as c, c.stream(transport=transport) as stream:
                with stream.open_step(a) as step:
                    arrays = [[rand(B, 1, H, D), rand(B, 1, KV, D), rand(B, 1, KV, D)] for _ in range(LAYERS)]
                    outs = [np.empty((B, 1, H, D), np.float32) for _ in range(LAYERS)]
                    futures = [step.submit_call(i, *arrays[i], out=outs[i]) for i in range(LAYERS)]
                    assert all(f.result() is o for f, o in zip(futures, outs))
            for i, arrs in enumerate(arrays):
                same(outs[i], ref.attend_stacked(twins, i, *arrs))
    finally:
        drop(ref, a, twins)


def test_a_call_reply_that_fails_leaves_out_unanswered(server, ref):
    """A call answered by an error (its layer called already) raises it; the sink its
    out= registered is dropped, and the next call's out= is answered as usual."""
    a = make(ref, 2)
    try:
        with ac.Client(server.url) as c, c.stream(transport="frames") as stream, stream.open_step(a) as step:
            q, k, v = rand(2, 1, H, D), rand(2, 1, KV, D), rand(2, 1, KV, D)
            out = np.empty_like(q)
            step.call(0, q, k, v, out=out)
            with pytest.raises(ac.StepLayerCalled):
                step.call(0, q, k, v, out=np.empty_like(q))
            assert not step._link._channel.sinks
            assert step.call(1, q, k, v, out=out) is out
    finally:
        drop(ref, a)


def test_an_out_that_does_not_fit_is_refused_unsent(steps, ref, monkeypatch):
    sent: list[Any] = []
    for cls in (ac._streams._FrameChannel, ac._streams._AsyncFrameChannel):
        original = cls.send_call
        monkeypatch.setattr(cls, "send_call", lambda self, *a, _o=original: sent.append(a) or _o(self, *a))
    a = make(ref)
    try:
        with steps.open(a, rows=2, return_lse=True) as step:
            q, k, v = rand(B, 2, H, D), rand(B, 2, KV, D), rand(B, 2, KV, D)
            wide = np.empty((B, 2, H, 2 * D), np.float32)
            cases = [
                (np.empty((B, 2, H, D + 1), np.float32), "another shape or dtype"),
                (np.empty((B, H, D), np.float32), "another shape or dtype"),  # q's shape is [B, 2, H, d]
                (np.empty((B, 2, H, D), np.float16), "another shape or dtype"),
                (wide[..., :D], "not C-contiguous"),
                (np.empty((B, 2, H, D), np.float32).T.copy().T, "not C-contiguous"),
                (np.frombuffer(bytes(q.nbytes), np.float32).reshape(q.shape), "read-only"),
                (q.tolist(), "not an array"),
                (torch.empty(B, 2, H, D, dtype=torch.float16), "another shape or dtype"),
                (torch.empty(B, H, 2, D).transpose(1, 2), "not contiguous"),
                (torch.empty(B, 2, H, D, device="meta"), "a tensor on meta"),
            ]
            for out, match in cases:
                refused_unsent(monkeypatch, lambda out=out: step.call(0, q, k, v, out=out), match)
            assert not sent
            got = step.call(0, q, k, v, out=np.empty_like(q))  # the step is as it was
            assert isinstance(got, ac.Attention) and got.lse.shape == (B, 2, H)
    finally:
        drop(ref, a)
