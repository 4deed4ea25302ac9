"""examples/decode_loop.py, run against the emulated server."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import numpy as np
import pytest

import attnserve_client as ac

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "decode_loop.py"


@pytest.fixture
def example(fake, monkeypatch):
    spec = importlib.util.spec_from_file_location("decode_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(
        module, "Client", lambda url, **kw: ac.Client(url, transport=httpx.MockTransport(fake.handler), **kw)
    )
    return module


ARGS = [
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--prompt",
    "11",
    "--chunk",
    "4",
    "--steps",
    "3",
]


def test_decode_loop_passes(example, fake, capsys):
    assert example.main(ARGS) == 0
    out = capsys.readouterr().out
    assert "cache lengths [14, 14] (expected 14 each)" in out and out.rstrip().endswith("ok")
    # 3 prefill chunks and 3 decode steps, per layer, each one fused attend.
    assert fake.count("POST", "/attend$") == 12 and fake.count("POST", "/kv$") == 0
    assert fake.sessions == {}  # deleted at the end


def test_decode_loop_fails_on_a_wrong_answer(example, fake, monkeypatch, capsys):
    real = fake._attend

    def off(s, layer, body):
        answer = real(s, layer, body)
        out = ac.wire.decode_array(answer["out"], name="out")
        answer["out"] = ac.wire.encode_array(out * (1 + 1e-3))
        return answer

    monkeypatch.setattr(fake, "_attend", off)
    assert example.main(ARGS) == 1
    assert "FAIL: error above 0.0001" in capsys.readouterr().err


def test_decode_loop_takes_the_formats_the_server_offers(example, fake, capsys):
    """--kv-format is checked against GET /v1/info kv_formats before any session exists."""
    assert example.main([*ARGS, "--kv-format", "turboquant"]) == 0
    capsys.readouterr()
    before = len(fake.requests)
    assert example.main([*ARGS, "--kv-format", "tq2o"]) == 2  # the fake offers f32 and turboquant
    assert "error: --kv-format 'tq2o': the server offers f32, turboquant" in capsys.readouterr().err
    assert [r.url.path for r in fake.requests[before:]] == ["/v1/info"] and fake.sessions == {}


def test_decode_loop_reports_an_unusable_server(example, fake, capsys):
    fake.fail("answer", status=507, slug="out-of-memory")
    assert example.main(ARGS) == 2
    assert "error: OutOfMemory: 507 out-of-memory" in capsys.readouterr().err


def test_reference_attention_matches_a_plain_loop(example, attention):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((3, 4, 8)), rng.standard_normal((9, 2, 8)), rng.standard_normal((9, 2, 8))
    np.testing.assert_allclose(
        example.reference_attention(q, k, v, 6), attention(q, k, v, 6, True, 8**-0.5), rtol=1e-12
    )
