"""Open steps: what ``open_step`` returns, over HTTP and over a stream, sync and async.

A step is an object the server holds over a fixed batch of sessions (``docs/api.md``,
"Steps"): opened once, called once per layer per token with only ``q``, ``k``, ``v``,
and closed. Its layer call answers exactly as ``attend_stacked`` with the same
arrays and options. The checks, requests and answers of a step are
:class:`~attnserve_client._steps.StepState`'s, written once; the classes here only
carry them: :class:`Step` and :class:`AsyncStep` over HTTP (``Client.open_step``,
``AsyncClient.open_step``), :class:`StreamStep` and :class:`AsyncStreamStep` over a
stream's connection (``Stream.open_step``, ``AsyncStream.open_step``: the WebSocket,
the frame and the shared-memory transports).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ._steps import StepState, call_arrays
from .errors import APIConnectionError, StepNotFound

if TYPE_CHECKING:  # annotations only
    from ._client import AsyncClient, Client
    from ._streams import _AsyncLink, _Link

__all__ = ["Step", "AsyncStep", "StreamStep", "AsyncStreamStep"]


class _StepHandle:
    """What every open step shows: its handle and what its opening fixed."""

    def __init__(self, state: StepState):
        self._state = state

    @property
    def id(self) -> int:
        """The step's handle (a positive int, scoped to this API key)."""
        return self._state.handle

    @property
    def layers(self) -> list[int]:
        """The layers the step calls, each once a token."""
        return list(self._state.layers)

    @property
    def token(self) -> int:
        """The token the step is at (from 0): it advances once every one of its
        layers has been called (as the answers said)."""
        return self._state.token

    @property
    def called(self) -> frozenset[int]:
        """The layers called so far in the current token."""
        return frozenset(self._state.called)

    @property
    def session_ids(self) -> list[str]:
        return list(self._state.session_ids)

    @property
    def sessions(self) -> list[Any]:
        """The sessions as given to ``open_step`` (objects or ids)."""
        return list(self._state.sessions)

    @property
    def rows(self) -> int:
        """The K/V rows each session appends per layer call (0: none)."""
        return self._state.rows

    @property
    def queries(self) -> int:
        """The query rows per session per layer call."""
        return self._state.queries

    @property
    def dtype(self) -> str:
        """The wire dtype of ``q``, ``k``, ``v`` (``"<f4"``, ``"<f2"``, ``"bfloat16"``)."""
        return self._state.dtype

    @property
    def broken(self) -> Any:
        """None, or the first call that applied to some sessions and failed for
        others (then the server refuses the step's calls: ``StepBroken``)."""
        return self._state.broken

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        s = self._state
        return (
            f"{type(self).__name__}(id={s.handle}, sessions={len(s.session_ids)}, layers={len(s.layers)}, "
            f"rows={s.rows}, queries={s.queries}, dtype={s.dtype!r}, token={s.token}"
            + (", closed" if s.closed else "")
            + ")"
        )


class Step(_StepHandle):
    """A step opened over HTTP (:meth:`Client.open_step`). A context manager: the
    block's end closes it."""

    def __init__(self, client: Client, state: StepState):
        super().__init__(state)
        self._client = client

    def call(self, layer: int, q: Any, k: Any = None, v: Any = None, *, out: Any = None) -> Any:
        """One layer call: item ``i`` attends ``q[i]`` after appending ``k[i]``,
        ``v[i]`` (``rows`` > 0) on the step's session ``i``. ``q`` is ``[B, queries,
        H, d]`` (``k``, ``v``: ``[B, rows, Hkv, d]``), or ``[B, H, d]`` when that axis
        is 1, in the step's dtype. Answers as ``attend_stacked`` does: the output in
        ``q``'s shape (a tensor when ``q`` is one; :class:`Attention` with
        ``return_lse``), :class:`BatchError` when items failed.

        ``out``: where the output goes instead of a new array: a C-contiguous,
        writable numpy array or torch tensor (CPU, or CUDA: through a pinned host
        buffer of the step's, copied to it on the stream current at the call, not
        blocking) of the answer's shape (``q``'s) and dtype (the step's
        ``out_dtype``, else its ``dtype``); the call answers ``out`` itself (with
        ``return_lse``, ``Attention(out, lse)``, ``lse`` a new float32 array, or a
        tensor as ``q``). Over the frame transport the reply is read off the
        socket straight into it, over shared memory copied from the region into it.

        Raises:
            InvalidRequest: (also an ``InvalidInput``, nothing sent) a layer not of
                the step, shapes or a dtype other than the step's, an ``out`` not
                as above.
            StepLayerCalled: the layer was called this token already.
            StepBroken, StepNotFound, ...: see ``docs/client.md``, "Steps".
        """
        return self._client._run(self._client._step_call_flow(self._state, layer, q, k, v, out))

    def info(self) -> dict[str, Any]:
        """The step as the server holds it (``GET /v1/steps/{step}``): its token,
        ``lengths``, ``broken``; :attr:`token` is refreshed from it."""
        return self._client._run(self._client._step_info_flow(self._state))

    def close(self) -> None:
        """Close the step (its sessions are free for other calls again). Closing a
        step closed already, or one the server no longer has, is no error."""
        self._client._run(self._client._step_close_flow(self._state))

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncStep(_StepHandle):
    """:class:`Step` for :class:`AsyncClient`: the same methods, awaitable; an async
    context manager."""

    def __init__(self, client: AsyncClient, state: StepState):
        super().__init__(state)
        self._client = client

    async def call(self, layer: int, q: Any, k: Any = None, v: Any = None, *, out: Any = None) -> Any:
        """See :meth:`Step.call`."""
        return await self._client._run(self._client._step_call_flow(self._state, layer, q, k, v, out))

    async def info(self) -> dict[str, Any]:
        """See :meth:`Step.info`."""
        return await self._client._run(self._client._step_info_flow(self._state))

    async def close(self) -> None:
        """See :meth:`Step.close`."""
        await self._client._run(self._client._step_close_flow(self._state))

    async def __aenter__(self) -> AsyncStep:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _call_members(state: StepState, layer: int, members: dict[str, Any]) -> dict[str, Any]:
    return {"step": state.handle, "layer": int(layer), **members}


class StreamStep(_StepHandle):
    """A step opened on a stream's connection (:meth:`Stream.open_step`), bound to
    it: the server closes it when the connection closes. Its calls pipeline
    (:meth:`submit_call`); the server runs those of one connection in the order sent."""

    def __init__(self, link: _Link, state: StepState):
        super().__init__(state)
        self._link = link

    def submit_call(self, layer: int, q: Any, k: Any = None, v: Any = None, *, out: Any = None) -> Future[Any]:
        """Send a layer call (:meth:`Step.call`) without waiting; its future gives
        the answer. The arrays may be reused once this returns (their bytes are
        sent); ``out`` (:meth:`Step.call`) is written until the future is done."""
        step, members = self._state.call(layer, q, k, v, out)
        state = self._state
        sink = None if step.dest is None else step.dest.sink()
        if self._link.call_frames:
            return self._link.submit_call(
                state.handle, int(layer), call_arrays(members), lambda d: state.finish(step, d), sink
            )
        return self._link.submit(
            "step_call", _call_members(state, layer, members), lambda d: state.finish(step, d), sink
        )

    def call(self, layer: int, q: Any, k: Any = None, v: Any = None, *, out: Any = None) -> Any:
        """See :meth:`Step.call`."""
        return self.submit_call(layer, q, k, v, out=out).result()

    def close(self) -> None:
        """Close the step (after its calls in flight). A step closed already, one the
        server no longer has, or one whose connection is gone (which closed it) is no error."""
        state = self._state
        if state.closed:
            return
        try:
            self._link.submit("step_close", {"step": state.handle}, lambda doc: None).result()
        except (StepNotFound, APIConnectionError):
            pass
        state.closed = True

    def __enter__(self) -> StreamStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncStreamStep(_StepHandle):
    """:class:`StreamStep` for :class:`AsyncStream`: ``await step.call(...)``;
    concurrent awaits pipeline (``asyncio.gather``)."""

    def __init__(self, link: _AsyncLink, state: StepState):
        super().__init__(state)
        self._link = link

    async def call(self, layer: int, q: Any, k: Any = None, v: Any = None, *, out: Any = None) -> Any:
        """See :meth:`Step.call`."""
        step, members = self._state.call(layer, q, k, v, out)
        state = self._state
        sink = None if step.dest is None else step.dest.sink()
        if self._link.call_frames:
            return await self._link.call_frame(
                state.handle, int(layer), call_arrays(members), lambda d: state.finish(step, d), sink
            )
        return await self._link.call(
            "step_call", _call_members(state, layer, members), lambda d: state.finish(step, d), sink
        )

    async def close(self) -> None:
        """See :meth:`StreamStep.close`."""
        state = self._state
        if state.closed:
            return
        try:
            await self._link.call("step_close", {"step": state.handle}, lambda doc: None)
        except (StepNotFound, APIConnectionError):
            pass
        state.closed = True

    async def __aenter__(self) -> AsyncStreamStep:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
