"""Hugging Face transformers on attnserve: ``model.generate()`` with every layer's
KV cache and attention on the server.

    import attnserve_client.transformers as ast
    from attnserve_client import Client
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=ast.ATTN_IMPLEMENTATION)
    with Client() as client:  # $ATTNSERVE_BASE_URL, else http://127.0.0.1:8421
        with ast.AttnServeCache(client, model.config, kv_format="tq4v3") as cache:
            out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before 5.24

Importing this module registers the attention function and its mask function
under the name ``"attnserve"`` (transformers' ``AttentionInterface`` and
``AttentionMaskInterface``). :class:`AttnServeCache` is a ``transformers.Cache``
that holds one attnserve session per sequence of the batch, made on the first
forward pass. Each layer's ``update`` hands its new K/V rows to the attention
function that runs right after it, which sends them with the queries as one
fused append + attend for the whole batch over the cache's stream: a layer call of
a step the cache holds open over the batch when every sequence adds the same rows
(decoding, or prompts without padding; a step for the prefill, then one for
decoding), else one item per sequence carrying only its real rows, so padding
never reaches the server. Long prompts go in chunks (``max_chunk_bytes`` a
request: whole sequences while one fits, else runs of one sequence's rows),
pipelined on the stream. Beam search and ``num_return_sequences`` reorder and copy sequences with
forks. See ``docs/transformers.md``.

:func:`generate_overlapped` (``_micro_batches.py``) is a greedy loop of its own for
Llama-family models: it runs the layers with the batch split into micro-batches
whose calls on the cache's stream overlap each other's torch work.

Needs ``torch`` and ``transformers`` >= 5 (the extra ``attnserve-client[transformers]``
asks for >= 5.24, where ``generate`` takes the cache as ``cache=``; before, it was
``past_key_values=``, which 5.24 and later still take, with a ``FutureWarning``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from . import tensors, wire
from ._step_handles import StreamStep
from ._steps import AttendItem, BatchError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttnServeCache",
    "OverlappedGeneration",
    "attention",
    "generate_overlapped",
    "padding_mask",
]

#: The name to give transformers: ``attn_implementation="attnserve"``.
ATTN_IMPLEMENTATION = "attnserve"

#: The largest request the cache sends by default (its rows of q, k and v, in the
#: model's dtype): long prompts go in chunks of rows of about this size.
DEFAULT_CHUNK_BYTES = 4 << 20

_pending = threading.local()  # the last update's (cache, layer, key, value), per thread
_WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes the wire carries as they are


class _Timeline(CacheLayerMixin):
    """One layer's length as transformers counts it: every position of the padded
    batch (padding included), which is what its masks and positions are built from.
    The rows themselves are on the server."""

    supports_early_init = False

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def advance(self, positions: int) -> None:
        """Count ``positions`` run outside ``update`` (``generate_overlapped``)."""
        self.is_initialized = True
        self.seen += positions

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self.is_initialized = False


def _check_config(config: Any) -> Any:
    """The decoder config the cache serves; refuses attention it does not compute."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        others = sorted({t for t in layer_types if t != "full_attention"})
        raise ValueError(f"attnserve computes full causal attention; this model has {others} layers")
    if layer_types is None and getattr(text, "sliding_window", None) is not None:
        if getattr(text, "use_sliding_window", True):
            raise ValueError("attnserve computes full causal attention; this model uses a sliding window")
    return text


class AttnServeCache(Cache):
    """A ``transformers.Cache`` whose rows live in attnserve sessions, one per
    sequence of the batch; the model must run with ``attn_implementation="attnserve"``.

    Args:
        client: an :class:`attnserve_client.Client`.
        config: the model's config (``model.config``): layers, heads, head_dim.
        kv_format: the sessions' kv format, one for all layers or one per layer.
        transport: the stream's transport, ``"websocket"``, ``"frames"`` or ``"shm"`` (a server on this host).
        max_chunk_bytes: the most q, k, v bytes (in the model's dtype) of one
            request: longer prompts are sent in chunks of rows.
        keep_sessions: leave the sessions on the server at :meth:`close`.
        **session: the other fields of ``Client.create_session`` (``sinks``,
            ``window``, ``exact_layers``, ``exact_format``, ``max_tokens``, ``seed``).

    ``stats`` counts the attention calls, their seconds, and the seconds of those
    spent waiting on the server (the rest is this process's conversions, encoding
    and bookkeeping); ``overlapped_seconds``: of the calls' round trips, the seconds
    this process spent on other work while they were in flight (only
    :func:`generate_overlapped` has any). Use it as a context manager, or call :meth:`close`.

    A decoding token allocates no buffer for its answers: each layer's step calls
    read their replies into a buffer the cache keeps for that layer (``out=`` of
    the step's call; pinned host memory for a CUDA model, copied to the device
    without blocking, and reused once that copy is done). On the CPU the attention
    output a decoding layer returns is that buffer itself, which the layer's next
    token overwrites (the model's ``o_proj`` has read it by then).
    """

    def __init__(
        self,
        client: Any,
        config: Any,
        *,
        kv_format: str | Sequence[str] = "f32",
        transport: str = "websocket",
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_sessions: bool = False,
        **session: Any,
    ):
        text = _check_config(config)
        self.num_layers = int(text.num_hidden_layers)
        super().__init__(layers=[_Timeline() for _ in range(self.num_layers)])
        self.client = client
        self.kv_format = kv_format if isinstance(kv_format, str) else list(kv_format)
        self.session_options = session
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.keep_sessions = keep_sessions
        self.stream = client.stream(transport=transport)
        self.sessions: list[Any] = []
        self.stats = {"calls": 0, "seconds": 0.0, "server_seconds": 0.0, "overlapped_seconds": 0.0}
        self._broken: str | None = None
        # the steps open on the stream, by the sequences they hold ([start, stop) of
        # the batch), with what they fixed: (rows a call, dtype, scale, causal)
        self._steps: dict[tuple[int, int], tuple[StreamStep, tuple[Any, ...]]] = {}
        # the decoding outputs, per layer and sequences of the batch (and shape, dtype,
        # device): a host tensor (pinned for a CUDA model) the step's call replies are
        # read into, its numpy view, and the event of its last copy to the device
        self._outs: dict[tuple[Any, ...], list[Any]] = {}

    # -- transformers' Cache ------------------------------------------------------

    def _timeline(self, layer: int) -> _Timeline:
        line = self.layers[layer]
        assert isinstance(line, _Timeline)
        return line

    def _check(self) -> None:
        if self._broken:
            raise RuntimeError(f"{self._broken}; reset() or close() it")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check()  # generate() asks first: a cache out of step refuses there
        return super().get_seq_length(layer_idx)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand this layer's new rows (``[B, kv_heads, n, head_dim]``) to the attention
        function that runs next; nothing is sent yet."""
        self._check()
        self._timeline(layer_idx).update(key_states, value_states)
        _pending.call = (self, layer_idx, key_states, value_states)
        return key_states, value_states

    def reset(self) -> None:
        """Forget every sequence (their sessions are deleted unless ``keep_sessions``);
        the cache is fresh afterwards even when a deletion fails (that error is raised)."""
        try:
            self._close_steps()
            if not self.keep_sessions:
                self._delete(self.sessions)
        finally:
            self.sessions = []
            self._steps = {}
            self._outs = {}
            self._broken = None
            super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Sequence ``i`` continues sequence ``beam_idx[i]`` (beam search)."""
        self._select([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([b for b in range(len(self.sessions)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("AttnServeCache does not crop (assisted decoding is not supported)")

    # -- sessions -----------------------------------------------------------------

    def _select(self, idx: list[int]) -> None:
        """Sequence ``i`` of the batch becomes what sequence ``idx[i]`` was: the first
        use of a sequence keeps its session, every other one is a fork of it (made
        before anything is deleted); sessions no longer used are deleted (dropped
        beams: even with ``keep_sessions``)."""
        if not self.sessions:
            return  # nothing sent yet: the sessions are made for the batch that comes
        if any(not 0 <= j < len(self.sessions) for j in idx):
            raise IndexError(f"batch indices {idx} out of range for a batch of {len(self.sessions)}")
        if idx == list(range(len(self.sessions))):
            return  # the batch as it is: its steps stay open
        self._close_steps()  # the steps' batches change (and a session in a step cannot be deleted)
        first: set[int] = set()
        chosen = []
        for j in idx:
            chosen.append(self.sessions[j] if j not in first else self.sessions[j].fork())
            first.add(j)
        self._delete([s for j, s in enumerate(self.sessions) if j not in first])
        self.sessions = chosen

    @staticmethod
    def _delete(sessions: list[Any]) -> None:
        for s in sessions:
            s.delete()

    def _make_sessions(self, batch: int, heads: int, kv_heads: int, head_dim: int) -> None:
        made: list[Any] = []
        try:
            for _ in range(batch):
                made.append(self.client.create_session(
                    num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_layers=self.num_layers,
                    kv_format=self.kv_format, **self.session_options,
                ))  # fmt: skip
        except BaseException:
            self._delete(made)  # all of the batch's sessions or none
            raise
        self.sessions = made

    def close(self) -> None:
        """Close the steps, delete the sessions (unless ``keep_sessions``) and close the stream."""
        try:
            self._close_steps()
            if not self.keep_sessions:
                self._delete(self.sessions)
        finally:
            self.sessions = []
            self._steps = {}
            self.stream.close()

    # -- steps ----------------------------------------------------------------------

    def _close_steps(self, start: int = 0, stop: int | None = None) -> None:
        """Close the open steps that hold any of the sequences ``[start, stop)`` (all
        by default); every one is closed before the first error is raised."""
        stop = len(self.sessions) if stop is None else stop
        failed: BaseException | None = None
        for key in [key for key in self._steps if key[0] < stop and start < key[1]]:
            step, _ = self._steps.pop(key)
            try:
                step.close()
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def _step(self, start: int, stop: int, rows: int, fixed: tuple[Any, ...]) -> StreamStep:
        """The step over the sequences ``[start, stop)`` whose calls append ``rows``
        rows each with these options (``fixed``: dtype, scale, causal): the open one,
        or a new one, the steps over any of those sequences closed first (the rows
        a call, the sequences or the options changed: prefill, then decoding)."""
        held = self._steps.get((start, stop))
        if held is not None and held[1] == (rows, *fixed):
            return held[0]
        self._close_steps(start, stop)
        dtype, scale, causal = fixed
        step: StreamStep = self.stream.open_step(
            self.sessions[start:stop], rows=rows, dtype=dtype, scale=scale, causal=causal
        )
        self._steps[start, stop] = (step, (rows, *fixed))
        return step

    def __enter__(self) -> AttnServeCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- attention ----------------------------------------------------------------

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        real: np.ndarray | None,
        scale: float | None,
        causal: bool,
    ) -> torch.Tensor:
        """Append ``key``, ``value`` (``[B, kv_heads, n, d]``) to ``layer`` of each
        sequence and attend ``query`` (``[B, heads, n, d]``) over it; ``real[b, i]``
        says whether row ``i`` of sequence ``b`` is a token (None: all are). Returns
        ``[B, n, heads, d]`` on ``query``'s device in its dtype, zero at padding."""
        if not self.sessions:
            batch, heads, _, d = query.shape
            with self._out_of_step_on_failure():
                self._make_sessions(batch, heads, key.shape[1], d)
        return self._collect(self._send(layer, query, key, value, real, scale, causal))

    @contextmanager
    def _out_of_step_on_failure(self, what: str = "a failed attention call") -> Iterator[None]:
        """A failure in the block leaves the cache out of step with the server (the
        layers' timeline moved at update(), the server may hold some of the rows):
        it refuses every use until reset(). A batch whose items failed raises the
        first sequence's own error (all are in its chain)."""
        try:
            yield
        except BaseException as exc:
            self._broken = f"{what} left the cache out of step with the server: {exc!r}"
            if isinstance(exc, BatchError):
                raise next(iter(exc.errors.values())) from exc
            raise

    def _send(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        real: np.ndarray | None,
        scale: float | None,
        causal: bool,
        rows: slice = slice(None),
    ) -> _InFlight:
        """Send :meth:`attend`'s fused append + attend for the sequences ``rows`` of
        the batch (their sessions made), without waiting: :meth:`_collect` takes its
        answer. Calls of disjoint ``rows`` may be in flight together on the stream."""
        started = time.perf_counter()
        batch, heads, n, d = query.shape
        kv_heads = key.shape[1]
        with self._out_of_step_on_failure():
            sessions = self.sessions[rows]
            first = rows.indices(len(self.sessions))[0]  # of the batch: the steps are by the batch's sequences
            if batch != len(sessions):
                raise ValueError(f"a batch of {batch} sequences for {len(sessions)} sessions of the cache")
            # [B, n, H, d] on the host, in the model's dtype (bfloat16, float16 and
            # float32 as they are; float64 as float32); the output comes back in q's
            q = tensors.as_wire_array(query.transpose(1, 2), name="q")
            k = tensors.as_wire_array(key.transpose(1, 2), name="k")
            v = tensors.as_wire_array(value.transpose(1, 2), name="v")
            row_bytes = batch * d * (heads * q.itemsize + 2 * kv_heads * k.itemsize)
            chunk_rows = max(1, self.max_chunk_bytes // row_bytes)
            if n == 1 and (real is None or real.all()) and query.dtype in _WIRE_DTYPES:
                # decoding: through the step, its replies read into the layer's output buffer
                held = self._layer_out(layer, first, (batch, n, heads, d), query)
                call = _InFlight(layer, query, held[1], held=held)
            else:
                call = _InFlight(layer, query, np.zeros((batch, n, heads, d), q.dtype))  # zero bits: 0.0 in any dtype
            if real is None or real.all():
                self._stacked(call, first, sessions, q, k, v, chunk_rows, scale, causal)
            else:
                self._close_steps(first, first + batch)
                self._items(call, sessions, q, k, v, real, chunk_rows, scale, causal)
        call.sent_at = time.perf_counter()
        call.host_seconds = call.sent_at - started
        return call

    def _layer_out(self, layer: int, first: int, shape: tuple[int, ...], query: torch.Tensor) -> list[Any]:
        """The decoding output buffer of ``layer`` for the sequences from ``first``:
        ``[tensor, its numpy view, event]``, made at the first decoding token (pinned
        host memory when ``query`` is on a CUDA device) and reused at every next one,
        once the last copy from it to the device is done."""
        key = (layer, first, shape, query.dtype, query.device)
        held = self._outs.get(key)
        if held is None:
            buf = torch.empty(shape, dtype=query.dtype, pin_memory=query.device.type == "cuda")
            held = self._outs[key] = [buf, tensors.host_view(buf), None]
        elif held[2] is not None:
            held[2].synchronize()  # the last token's copy to the device has read it
            held[2] = None
        return held

    def _collect(self, call: _InFlight) -> torch.Tensor:
        """Wait for the answers of a call :meth:`_send` sent; its output as
        :meth:`attend` returns it. Counts the call in ``stats``."""
        started = time.perf_counter()
        with self._out_of_step_on_failure():
            for part, fut in call.chunks:
                got = fut.result()
                if call.held is None:  # (else the answer was read into call.out: out=)
                    call.out[part] = got
            for where, fut in call.items:
                for (b, sel), got in zip(where, fut.result()):
                    call.out[b, sel] = got
        waited = time.perf_counter() - started
        answer: torch.Tensor
        if call.held is None:
            answer = tensors.answer(call.out, call.query)
        elif call.query.device.type == "cpu":
            answer = call.held[0]  # the layer's buffer itself: o_proj reads it before the layer's next call
        else:
            buf = call.held[0]
            answer = buf.to(call.query.device, non_blocking=bool(buf.is_pinned()))
            if call.query.device.type == "cuda":
                call.held[2] = torch.cuda.Event()
                call.held[2].record()  # the next token's reply waits for this copy (_layer_out)
        self.stats["calls"] += 1
        self.stats["seconds"] += call.host_seconds + time.perf_counter() - started
        self.stats["server_seconds"] += waited
        # of the round trip, what passed before this wait began: this process's other work
        self.stats["overlapped_seconds"] += max(0.0, min(call.answered_at(), started) - call.sent_at)
        return answer

    @staticmethod
    def _held(sessions: list[Any], layer: int) -> np.ndarray:
        """The rows each of ``sessions`` holds in ``layer`` (its real tokens only:
        padding is never sent), as the client tracks them from every answer."""
        return np.array([s.lengths[layer] for s in sessions], np.int64)

    def _stacked(
        self, call: _InFlight, first: int, sessions: list[Any], q: np.ndarray, k: np.ndarray, v: np.ndarray,
        rows: int, scale: float | None, causal: bool,
    ) -> None:  # fmt: skip
        """Every sequence adds all its n rows: stacked calls of at most ``rows`` rows
        of the whole batch's worth of bytes each. Each call takes whole sequences
        (a run of them, all their rows) while one sequence's rows fit: a layer call
        of the step over that run (opened at its first layer, kept while its rows a
        call stay the same: every layer of the prefill, then of every decoding
        token); else one sequence's rows in runs, stacked attends with their offsets
        (a layer would be called more than once a token: no step). Either way a
        call's arrays are contiguous runs of ``q``, ``k``, ``v`` ([B, n, heads, d]),
        sent without a copy. ``first``: the batch's index of ``sessions[0]``."""
        batch, n = q.shape[:2]
        per_step = rows * batch // n  # whole sequences a call holds
        if per_step >= 1:
            fixed = (wire.dtype_name(q), scale, causal)
            for b in range(0, batch, per_step):
                seqs = slice(b, min(b + per_step, batch))
                step = self._step(first + seqs.start, first + seqs.stop, n, fixed)
                into = {} if call.held is None else {"out": call.out[seqs]}
                call.add_chunk((seqs, slice(0, n)), step.submit_call(call.layer, q[seqs], k[seqs], v[seqs], **into))
            return
        self._close_steps(first, first + batch)
        base = self._held(sessions, call.layer)
        parts = [(slice(b, b + 1), slice(c, c + rows)) for b in range(batch) for c in range(0, n, rows)]
        for seqs, chunk in parts:
            call.add_chunk((seqs, chunk), self.stream.submit_attend_stacked(
                sessions[seqs], call.layer, q[seqs, chunk], k[seqs, chunk], v[seqs, chunk],
                offsets=(base[seqs] + chunk.start).tolist(), scale=scale, causal=causal,
            ))  # fmt: skip

    def _items(
        self, call: _InFlight, sessions: list[Any], q: np.ndarray, k: np.ndarray, v: np.ndarray, real: np.ndarray,
        rows: int, scale: float | None, causal: bool,
    ) -> None:  # fmt: skip
        """Each sequence adds only its real rows: one item per sequence and chunk."""
        picked = [np.flatnonzero(r) for r in real]
        longest = max(len(p) for p in picked)
        base = self._held(sessions, call.layer)
        for c in range(0, longest, rows):
            items, where = [], []
            for b, p in enumerate(picked):
                sel = p[c : c + rows]
                if len(sel):
                    items.append(AttendItem(
                        sessions[b], call.layer, q[b, sel], k[b, sel], v[b, sel],
                        offset=int(base[b] + c), scale=scale, causal=causal,
                    ))  # fmt: skip
                    where.append((b, sel))
            call.add_items(where, self.stream.submit_attend_batch(items))


@dataclass(eq=False)
class _InFlight:
    """One attention call sent on the stream (``AttnServeCache._send``) whose answers
    are not collected yet: its requests' futures, and where their answers go."""

    layer: int
    query: torch.Tensor  # the queries as given: the output comes back on their device, in their dtype
    out: np.ndarray  # [B, n, heads, d]: zero at padding, filled as the answers are collected
    # decoding: the layer's output buffer (AttnServeCache._layer_out) that out views,
    # into which the step's calls read their answers (None: out is this call's own)
    held: list[Any] | None = None
    # stacked steps: (sequences, rows)
    chunks: list[tuple[tuple[slice, slice], Future[Any]]] = field(default_factory=list)
    items: list[tuple[list[tuple[int, np.ndarray]], Future[Any]]] = field(default_factory=list)  # (sequence, rows)
    sent_at: float = 0.0  # when the last request was sent (time.perf_counter)
    host_seconds: float = 0.0  # this process's time converting and sending
    answered: list[float] = field(default_factory=list)  # when each answer arrived (the stream's reader appends)

    def add_chunk(self, chunk: tuple[slice, slice], fut: Future[Any]) -> None:
        self.chunks.append((chunk, fut))
        self._time(fut)

    def add_items(self, where: list[tuple[int, np.ndarray]], fut: Future[Any]) -> None:
        self.items.append((where, fut))
        self._time(fut)

    def _time(self, fut: Future[Any]) -> None:
        fut.add_done_callback(lambda _: self.answered.append(time.perf_counter()))

    def answered_at(self) -> float:
        """When the last answer arrived (once every future is done)."""
        return max(self.answered, default=self.sent_at)

    def futures(self) -> list[Future[Any]]:
        return [fut for _, fut in self.chunks] + [fut for _, fut in self.items]


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers hands the attention function: the 2D padding mask of
    the ``kv_length`` positions (True: a token), or None when nothing is padding.
    Causality is the server's (every attend is causal over the rows sent)."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(f"attnserve takes a 2D padding mask, got one of shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    return None if bool(mask.all()) else mask


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``attn_implementation="attnserve"``:
    the fused append + attend of the rows the :class:`AttnServeCache` was just
    handed, for the whole batch. Returns ``[B, n, heads, d]`` and no weights."""
    call = getattr(_pending, "call", None)
    _pending.call = None
    layer = getattr(module, "layer_idx", None)
    if call is None or call[1] != layer or call[2] is not key:
        raise RuntimeError(
            'attn_implementation="attnserve" needs cache=AttnServeCache(...) (past_key_values= before '
            "transformers 5.24) and use_cache=True: the rows of this layer were not handed to an AttnServeCache"
        )
    for name in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attnserve does not compute attention with {name}")
    if dropout:
        raise ValueError("attnserve does not compute attention dropout (run the model in eval mode)")
    cache: AttnServeCache = call[0]
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError("attnserve takes the 2D padding mask of its own mask function")
    real = None
    if attention_mask is not None:
        real = attention_mask[:, -query.shape[2] :].cpu().numpy()
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    return cache.attend(layer, query, call[2], call[3], real, scaling, causal), None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)

# the micro-batch loop (it uses the cache above): attnserve_client.transformers.generate_overlapped
from ._micro_batches import OverlappedGeneration, generate_overlapped  # noqa: E402
