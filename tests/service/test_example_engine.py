"""examples/engine_batch.py against the real server: batched steps over the stream
and over HTTP, plain and compressed kv formats, checked against float64 inside the example."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_batch.py"


@pytest.fixture
def example():
    spec = importlib.util.spec_from_file_location("engine_batch", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGS = [
    "--sequences",
    "5",
    "--layers",
    "3",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--prompt",
    "13",
    "--steps",
    "4",
]


@pytest.mark.parametrize("transport", ["stream", "http"])
@pytest.mark.parametrize("fmt", ["f32", "turboquant", "f16", "bf16", "tq2o"])
def test_engine_loop_passes(example, server, capsys, transport, fmt):
    assert example.main([*ARGS, "--url", server.url, "--transport", transport, "--kv-format", fmt]) == 0
    out = capsys.readouterr().out
    assert "cache lengths [17, 14, 11, 8, 5]" in out and out.rstrip().endswith("ok")
    assert "3 layers" in out and "75 attends" in out


def test_engine_loop_fails_on_a_wrong_answer(example, server, monkeypatch, capsys):
    real = example.reference_attention
    monkeypatch.setattr(example, "reference_attention", lambda *a: real(*a) * (1 + 1e-3))
    assert example.main([*ARGS, "--url", server.url]) == 1
    assert "FAIL: error above 0.0001" in capsys.readouterr().err


def test_engine_loop_takes_only_the_servers_formats(example, server, capsys):
    """--kv-format is any format GET /v1/info lists; another is exit 2 naming them."""
    from attnserve.formats import KV_FORMATS

    assert example.main([*ARGS, "--url", server.url, "--kv-format", "tq9"]) == 2
    assert f"error: --kv-format 'tq9': the server offers {', '.join(KV_FORMATS)}" in capsys.readouterr().err
