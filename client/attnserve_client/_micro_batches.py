"""Micro-batches in flight: greedy generation on attnserve whose layer calls overlap
the model's own work (``attnserve_client.transformers.generate_overlapped``).

``model.generate`` runs each layer for the whole batch and waits on its attention
call: the server's round trip and the model's own work (norms, projections, MLP)
add up. Here the layers of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3)
run outside ``model.forward``, the batch split into micro-batches (contiguous rows)
that take turns: while one micro-batch's fused append + attend is on the server,
the next one's torch work runs, so the round trip hides behind it (the ping-pong of
attention-FFN disaggregation).

Each micro-batch is a program (a generator) that runs its layers in order and
stops at every attention call it sends; a round-robin driver resumes them in turn.
Resumed, a micro-batch collects the answer it sent last (the others' are still in
flight), runs that layer's output projection, residual and MLP, then the next
layer's norm, projections and rotary embedding, sends that layer's call, and yields.
Its step ends with the final norm, the LM head and the greedy token, and it goes
straight on to its next step (a micro-batch never waits for the others' tokens).
One :class:`~attnserve_client.transformers.AttnServeCache` holds every sequence: a
micro-batch's calls carry its rows' sessions, over the cache's one stream, through
the cache's own sending (chunks, padding) and counting.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .transformers import AttnServeCache, _check_config, _InFlight

__all__ = ["OverlappedGeneration", "SUPPORTED_MODELS", "generate_overlapped", "micro_batch_sizes"]

logger = logging.getLogger("attnserve_client.transformers")

#: The causal LMs whose layers :func:`generate_overlapped` runs, by class: their
#: decoder layer's and attention's classes, and whether the attention normalises
#: q and k per head (Qwen3's ``q_norm``, ``k_norm``).
SUPPORTED_MODELS: dict[str, tuple[str, str, bool]] = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", False),
    "MistralForCausalLM": ("MistralDecoderLayer", "MistralAttention", False),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention", False),
    "Qwen3ForCausalLM": ("Qwen3DecoderLayer", "Qwen3Attention", True),
}

#: Rotary embeddings whose frequencies follow the batch's longest position
#: (``dynamic_rope_update``): a micro-batch would see other frequencies than the batch.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")

#: ``generation_config`` fields whose logits processors change greedy tokens, with
#: the value that adds none; ``generate_overlapped`` takes the raw argmax, so it
#: refuses a model whose generation config sets any of them.
_GREEDY_CHANGING = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0,
    "watermarking_config": None,
}


@dataclass
class OverlappedGeneration:
    """What :func:`generate_overlapped` returns.

    Attributes:
        sequences: ``[B, prompt + new]``, the prompts and their greedy tokens, as
            ``model.generate`` returns them (a finished sequence's tokens after its
            EOS are the pad token).
        logits: with ``output_logits``, one ``[B, vocab]`` float32 tensor per new
            token, the raw logits it was chosen from; NaN in the rows of a
            micro-batch that had stopped (every sequence of it past its EOS: it runs
            no more steps, where ``generate`` keeps computing padding). Else None.
        stats: this run's ``micro_batches`` (how many ran), ``micro_batch_sizes``,
            ``fallback`` (why fewer ran than asked for, else None), ``steps`` (the
            forward passes of the longest micro-batch), ``seconds`` (the whole run),
            and the cache's counters over the run: ``attention_calls``,
            ``attention_seconds``, ``server_seconds`` (blocked on answers) and
            ``overlapped_seconds`` (of the calls' round trips, the time this
            process spent on another micro-batch's work instead of waiting).
    """

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...] | None
    stats: dict[str, Any]


@dataclass(frozen=True)
class _Layout:
    """The modules of a supported causal LM that the micro-batches run."""

    embed: Any
    rotary: Any
    layers: list[Any]
    norm: Any
    head: Any
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the model's own apply_rotary_pos_emb
    qk_norm: bool
    heads: int
    kv_heads: int
    head_dim: int


def _layout(model: Any) -> _Layout:
    """The modules of ``model``; refuses a model the micro-batch loop does not run
    as its own ``forward`` does."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise ValueError(
            f"generate_overlapped runs the layers of {', '.join(sorted(SUPPORTED_MODELS))}; got {name} "
            "(use model.generate with an AttnServeCache)"
        )
    layer_class, attention_class, qk_norm = SUPPORTED_MODELS[name]
    _check_config(model.config)  # full causal attention in every layer, as the cache's
    if model.training:
        raise ValueError("generate_overlapped runs inference only (run the model in eval mode)")
    inner: Any = model.model
    config: Any = model.config
    layers = list(inner.layers[: config.num_hidden_layers])
    for i, layer in enumerate(layers):
        if type(layer).__name__ != layer_class or type(layer.self_attn).__name__ != attention_class:
            raise ValueError(
                f"generate_overlapped: layer {i} of {name} is {type(layer).__name__} with "
                f"{type(layer.self_attn).__name__}, not {layer_class} with {attention_class}"
            )
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type in _BATCH_DEPENDENT_ROPE:
        raise ValueError(
            f"generate_overlapped: the {rope_type!r} rotary embedding follows the batch's longest position, "
            "which a micro-batch does not see (use model.generate)"
        )
    attn: Any = layers[0].self_attn
    rotate = getattr(importlib.import_module(type(attn).__module__), "apply_rotary_pos_emb")
    return _Layout(
        embed=inner.embed_tokens,
        rotary=inner.rotary_emb,
        layers=layers,
        norm=inner.norm,
        head=model.lm_head,
        rotate=rotate,
        qk_norm=qk_norm,
        heads=int(config.num_attention_heads),
        kv_heads=int(config.num_key_value_heads),
        head_dim=int(attn.head_dim),
    )


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(x) for x in value]


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """The sizes of the micro-batches a batch splits into: as even as can be, the
    larger first (5 into 2: 3 and 2); at most one per sequence."""
    count = min(micro_batches, batch)
    return [batch // count + (i < batch % count) for i in range(count)]


@dataclass
class _Decoding:
    """Greedy decoding's rules, from the arguments and the model's generation config."""

    max_new_tokens: int
    min_new_tokens: int
    min_length: int
    eos: list[int]
    pad: int | None
    width: int  # the (padded) prompt's length

    def pick(self, logits: torch.Tensor, step: int, unfinished: torch.Tensor) -> torch.Tensor:
        """The next tokens from one step's float32 logits (``generate``'s greedy
        search: EOS barred while too short, padding after a sequence's EOS)."""
        scores = logits
        if self.eos and (step < self.min_new_tokens or self.width + step < self.min_length):
            scores = logits.clone()
            scores[:, self.eos] = -float("inf")
        tokens = torch.argmax(scores, dim=-1)
        if self.eos:
            assert self.pad is not None
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, self.pad))
        return tokens


class _Run:
    """One :func:`generate_overlapped`: the inputs, and the tokens and logits the
    micro-batches write as they go."""

    def __init__(
        self,
        layout: _Layout,
        cache: AttnServeCache,
        decoding: _Decoding,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        output_logits: bool,
        vocab: int,
    ):
        self.layout, self.cache, self.decoding = layout, cache, decoding
        self.input_ids = input_ids
        self.real = mask.to(torch.bool).cpu().numpy()  # [B, width]: which prompt rows are tokens
        # generate()'s positions: counted over each sequence's tokens (padding at 0)
        self.positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        batch = input_ids.shape[0]
        fill = decoding.pad if decoding.pad is not None else 0
        self.tokens = torch.full((batch, decoding.max_new_tokens), fill, dtype=input_ids.dtype, device=input_ids.device)
        self.steps = [0] * batch  # per sequence, the tokens its micro-batch chose
        self.logits: list[torch.Tensor] | None = [] if output_logits else None
        self.vocab = vocab

    def record(self, rows: slice, step: int, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        self.tokens[rows, step] = tokens
        for b in range(*rows.indices(len(self.steps))):
            self.steps[b] = step + 1
        if self.logits is not None:
            while len(self.logits) <= step:  # NaN until computed: a stopped micro-batch's rows stay NaN
                self.logits.append(
                    torch.full((len(self.steps), self.vocab), float("nan"), dtype=torch.float32, device=logits.device)
                )
            self.logits[step][rows] = logits

    def micro_batch(self, rows: slice) -> Generator[_InFlight, None, None]:
        """The program of the micro-batch of sequences ``rows``: its steps, layer by
        layer, yielding after each attention call it sends (collected when resumed)."""
        lay, cache, decoding = self.layout, self.cache, self.decoding
        ids = self.input_ids[rows]
        positions = self.positions[rows]
        real: np.ndarray | None = self.real[rows]
        if real is not None and real.all():
            real = None
        unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        eos = torch.tensor(decoding.eos, dtype=ids.dtype, device=ids.device)
        for step in range(decoding.max_new_tokens):
            hidden = lay.embed(ids)
            cos, sin = lay.rotary(hidden, position_ids=positions)
            for index, layer in enumerate(lay.layers):
                attn = layer.self_attn
                residual = hidden
                x = layer.input_layernorm(hidden)
                heads_shape = (*x.shape[:-1], -1, lay.head_dim)  # [b, n, heads, d]
                q = attn.q_proj(x).view(heads_shape)
                k = attn.k_proj(x).view(heads_shape)
                if lay.qk_norm:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                v = attn.v_proj(x).view(heads_shape).transpose(1, 2)
                q, k = lay.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                call = cache._send(index, q, k, v, real, attn.scaling, getattr(attn, "is_causal", True), rows)
                yield call  # the other micro-batches run while this call is on the server
                out = cache._collect(call)  # [b, n, heads, d]
                hidden = residual + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
                residual = hidden
                hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
            # the last position only, as generate() asks (logits_to_keep=1)
            logits = lay.head(lay.norm(hidden[:, -1:]))[:, -1].to(copy=True, dtype=torch.float32)
            tokens = decoding.pick(logits, step, unfinished)
            self.record(rows, step, tokens, logits)
            if decoding.eos:
                unfinished &= ~torch.isin(tokens, eos)
                if not bool(unfinished.any()):
                    return  # every sequence past its EOS: the rest of its tokens are padding
            ids = tokens[:, None]
            positions = positions[:, -1:] + 1
            real = None


def _interleave(programs: list[Generator[_InFlight, None, None]]) -> None:
    """Run the micro-batches' programs in turns, each to its next attention call,
    until every one has finished. On a failure, the calls still in flight settle
    before the error goes up (none is left unanswered on the stream)."""
    in_flight: dict[int, _InFlight] = {}
    turns = deque(range(len(programs)))
    try:
        while turns:
            i = turns.popleft()
            try:
                in_flight[i] = next(programs[i])
            except StopIteration:
                in_flight.pop(i, None)
                continue
            turns.append(i)
    except Exception:
        wait_for_futures([f for call in in_flight.values() for f in call.futures()])
        raise
    finally:
        for program in programs:
            program.close()


def _checked_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask: expected 0 (padding) and 1 (a token)")
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or not bool(mask[:, -1].all()):
        raise ValueError(
            "generate_overlapped takes left-padded prompts (every sequence's padding before its tokens, "
            "its last position a token): pad on the left (tokenizer.padding_side = 'left')"
        )
    return mask


def _check_generation_config(config: Any) -> None:
    if config is None:
        return
    changing = {
        name: getattr(config, name)
        for name, neutral in _GREEDY_CHANGING.items()
        if getattr(config, name, None) not in (None, neutral)
    }
    if changing:
        raise ValueError(
            f"generate_overlapped picks the raw argmax; the model's generation_config asks for {changing}, "
            "which model.generate would apply (reset them on model.generation_config, or use model.generate)"
        )
    if getattr(config, "do_sample", None):
        logger.warning("generate_overlapped decodes greedily: the generation config's do_sample=True is not followed")


def generate_overlapped(
    model: Any,
    input_ids: torch.Tensor,
    cache: AttnServeCache,
    max_new_tokens: int,
    *,
    micro_batches: int = 2,
    attention_mask: torch.Tensor | None = None,
    min_new_tokens: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    output_logits: bool = False,
) -> OverlappedGeneration:
    """Greedy generation on attnserve with the batch split into ``micro_batches``
    whose attention calls overlap each other's torch work (see the module's docs
    and docs/transformers.md#micro-batches-in-flight).

    Args:
        model: a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
            or ``Qwen3ForCausalLM`` in eval mode (its ``attn_implementation`` is not
            used: the loop runs the layers' modules itself).
        input_ids: ``[B, width]`` prompts, left-padded when of different lengths.
        cache: a fresh :class:`AttnServeCache` made for ``model.config`` (its
            sessions are made here, one per sequence; it holds them afterwards).
        max_new_tokens: the most tokens to generate (fewer when every sequence
            reaches an EOS token).
        micro_batches: how many micro-batches (contiguous rows, as even as can be):
            1 runs the same loop with nothing overlapped; a batch of fewer
            sequences runs one per sequence (``stats["fallback"]`` says so, and a
            warning is logged).
        attention_mask: ``[B, width]``, 1 at tokens and 0 at the padding on their
            left (None: no padding). Padding never reaches the server.
        min_new_tokens: EOS is barred for that many tokens (None: the generation
            config's); so is it while prompt and tokens are shorter than the
            generation config's ``min_length``, as ``model.generate`` does.
        eos_token_id, pad_token_id: as ``model.generate`` (None: the generation
            config's; no pad token but an EOS one: the first EOS pads, logged).
        output_logits: also return each step's raw logits.

    Returns:
        an :class:`OverlappedGeneration`: ``sequences``, ``logits``, ``stats``.

    Greedy tokens are ``model.generate``'s (``do_sample=False``) with the same
    cache settings; a generation config whose logits processors would change them
    (a repetition penalty, forced or suppressed tokens, ...) is refused, and one
    with ``do_sample=True`` is decoded greedily all the same (logged).
    """
    layout = _layout(model)
    if not isinstance(cache, AttnServeCache):
        raise TypeError(f"cache: expected an AttnServeCache, got {type(cache).__name__}")
    if cache.num_layers != len(layout.layers):
        raise ValueError(f"cache: made for {cache.num_layers} layers, the model has {len(layout.layers)}")
    if cache.get_seq_length() != 0 or cache.sessions:  # get_seq_length refuses a cache out of step
        raise ValueError("generate_overlapped starts from a fresh cache (reset() it, or make a new one)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or 0 in input_ids.shape:
        raise ValueError("input_ids: expected a [batch, length] tensor of token ids, neither empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches: expected an int >= 1, got {micro_batches!r}")
    generation: Any = getattr(model, "generation_config", None)
    _check_generation_config(generation)
    eos = _token_ids(eos_token_id if eos_token_id is not None else getattr(generation, "eos_token_id", None))
    pad = pad_token_id if pad_token_id is not None else getattr(generation, "pad_token_id", None)
    if pad is None and eos:
        logger.warning("generate_overlapped: no pad token: the EOS token %d pads finished sequences", eos[0])
        pad = eos[0]
    if min_new_tokens is None:
        min_new_tokens = getattr(generation, "min_new_tokens", None) or 0
    device = layout.embed.weight.device
    input_ids = input_ids.to(device)
    mask = _checked_mask(input_ids, None if attention_mask is None else attention_mask.to(device))
    batch, width = input_ids.shape
    decoding = _Decoding(
        max_new_tokens=max_new_tokens,
        min_new_tokens=int(min_new_tokens),
        min_length=int(getattr(generation, "min_length", None) or 0),
        eos=eos,
        pad=None if pad is None else int(pad),
        width=width,
    )

    sizes = micro_batch_sizes(batch, micro_batches)
    fallback = None
    if len(sizes) < micro_batches:
        fallback = (
            f"a batch of {batch} sequence{'s' if batch > 1 else ''} runs {len(sizes)} micro-batch"
            f"{'es' if len(sizes) > 1 else ''}, not {micro_batches}"
            + (": nothing overlaps (the plain loop)" if len(sizes) == 1 else "")
        )
        logger.warning("generate_overlapped: %s", fallback)
    starts = np.cumsum([0, *sizes])
    before = dict(cache.stats)
    started = time.perf_counter()
    cache._make_sessions(batch, layout.heads, layout.kv_heads, layout.head_dim)  # all of them or none
    run = _Run(layout, cache, decoding, input_ids, mask, output_logits, int(model.config.vocab_size))
    with torch.no_grad(), cache._out_of_step_on_failure("a failed step of generate_overlapped"):
        _interleave([run.micro_batch(slice(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])])
    steps = max(run.steps)
    for layer in range(cache.num_layers):  # the positions the batch ran, as the layers' timeline counts them
        cache._timeline(layer).advance(width + steps - 1)
    stats = {
        "micro_batches": len(sizes),
        "micro_batch_sizes": sizes,
        "fallback": fallback,
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "attention_calls": cache.stats["calls"] - before["calls"],
        "attention_seconds": cache.stats["seconds"] - before["seconds"],
        "server_seconds": cache.stats["server_seconds"] - before["server_seconds"],
        "overlapped_seconds": cache.stats["overlapped_seconds"] - before["overlapped_seconds"],
    }
    logits = None if run.logits is None else tuple(run.logits)
    return OverlappedGeneration(torch.cat([input_ids, run.tokens[:, :steps]], dim=1), logits, stats)
