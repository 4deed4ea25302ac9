"""loadtest.py --batched against the real server: an engine-shaped closed loop (one
batched step per layer for all sessions), verified against float64, no errors, over
each transport (the WebSocket stream, HTTP, the frame transport, shared memory)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def _run(server, tmp_path, *extra: str) -> dict:
    return _run_logged(server, tmp_path, *extra)[0]


def _run_logged(server, tmp_path, *extra: str) -> tuple[dict, str]:
    """The report and what the run wrote to stderr (the progress lines)."""
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "loadtest" / "loadtest.py"),
            "--url",
            server.url,
            "--duration",
            "3",
            "--sessions",
            "3",
            "--layers",
            "2",
            "--prefill",
            "20",
            "--chunk",
            "8",
            "--decode-steps",
            "5",
            "--qo-heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--progress",
            "off",
            "--seed",
            "7",
            "--json-out",
            str(out),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(out.read_text()), r.stderr


@pytest.mark.parametrize("transport", ["stream", "http"])
def test_batched_mode_runs_cohorts_verified(server, tmp_path, transport):
    report = _run(server, tmp_path, "--batched", "--transport", transport, "--verify", "0.5")
    ops = report["operations"]
    assert report["error_count"] == 0, report["errors"]
    # each cohort: 3 prefill chunks x 2 layers, then 5 tokens x 2 layers, 3 sessions per batch
    assert ops["prefill_batch"]["count"] >= 6 and ops["decode_batch"]["count"] >= 10
    assert ops["decode_step"]["count"] == ops["decode_batch"]["count"] // 2
    assert ops["decode"]["count"] == 0 and ops["prefill_chunk"]["count"] == 0
    assert report["totals"]["sessions_started"] % 3 == 0
    assert report["verify"]["checked"] > 0 and report["verify"]["failed"] == 0
    # the steps went over the transport asked for: batch POSTs only over HTTP
    posts = sum(
        value
        for m in report["server_metrics"].values()
        for key, value in m["delta"].items()
        if key.startswith("attnserve_requests_total{") and 'route="/v1/batch/attend"' in key
    )
    assert (posts >= ops["decode_batch"]["count"]) if transport == "http" else posts == 0, posts


@pytest.mark.parametrize(("transport", "route"), [("frames", "/v1/frames"), ("shm", "/v1/shm")])
def test_batched_mode_over_frames_and_shared_memory(shm_server, tmp_path, transport, route):
    report = _run(shm_server, tmp_path, "--batched", "--transport", transport, "--verify", "0.5", "--warmup-s", "1")
    ops = report["operations"]
    assert report["error_count"] == 0, report["errors"]
    assert report["config"]["transport"] == transport
    assert ops["prefill_batch"]["count"] >= 6 and ops["decode_batch"]["count"] >= 10
    assert report["verify"]["checked"] > 0 and report["verify"]["failed"] == 0
    # every step went over that transport: its replies counted, none over /v1/stream or HTTP
    delta = {k: v for m in report["server_metrics"].values() for k, v in m["delta"].items()}
    steps = ops["prefill_batch"]["count"] + ops["decode_batch"]["count"]
    replies = sum(v for k, v in delta.items() if k.startswith("attnserve_requests_total{") and f'route="{route}"' in k)
    assert replies >= steps, (replies, steps)
    others = ("/v1/stream", "/v1/batch/attend")
    assert not [k for k, v in delta.items() if v and k.startswith("attnserve_requests_total{") and any(
        f'route="{r}"' in k for r in others
    )]  # fmt: skip


def test_batched_mode_progress_line_counts_the_attends(server, tmp_path):
    # the live line counts the attends and tokens of batched steps as the summary
    # does (it used to count only single attends: "attends 0.0/s" under --batched)
    extra = ("--batched", "--duration", "6", "--decode-steps", "0", "--progress", "log")
    report, log = _run_logged(server, tmp_path, *extra)
    assert report["error_count"] == 0, report["errors"]
    lines = [ln for ln in log.splitlines() if "attends" in ln and "/s" in ln]
    assert lines, log
    rate = float(re.search(r"attends +([0-9.]+)/s", lines[0]).group(1))
    tokens = float(re.search(r"tokens +([0-9.]+)/s", lines[0]).group(1))
    assert rate > 0 and tokens > 0, lines[0]
    assert report["throughput"]["attends_per_s"] > 0


def test_batched_mode_refuses_open_loop(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "loadtest.py"), "--batched", "--mode", "open", "--rate", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--batched runs a closed loop" in r.stderr


def test_a_stream_transport_needs_batched(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "loadtest.py"), "--transport", "shm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--transport shm carries --batched steps" in r.stderr


def test_a_large_step_is_split_and_keeps_item_order(server, rng, monkeypatch):
    import asyncio

    import numpy as np

    from attnserve_client import AsyncClient

    from loadtest import loadtest as lt

    monkeypatch.setattr(lt.driver, "BATCH_BYTES", 4 * (4 * 8 + 2 * 2 * 8) * 2)  # two items' arrays per request

    async def main():
        async with AsyncClient(server.url) as client:
            sessions = [await client.create_session(num_qo_heads=4, num_kv_heads=2, head_dim=8) for _ in range(5)]
            q, k, v = (rng.standard_normal((5, 1, h, 8)).astype(np.float32) for h in (4, 2, 2))
            sent = []
            stacked = client.attend_stacked

            async def counted(part, *args, **kw):
                sent.append(len(part))
                return await stacked(part, *args, **kw)

            client.attend_stacked = counted
            test = lt.LoadTest.__new__(lt.LoadTest)
            outs = await test._attend_stacked(client, sessions, 0, q, k, v)
            singles = []
            for i, s in enumerate(sessions):
                assert s.lengths == (1,)  # tracked from the answer: the next offset
                singles.append(await s.attend(0, q[i]))
                await s.delete()
            return outs, singles, sent

    outs, singles, sent = asyncio.run(main())
    assert sent == [2, 2, 1] and outs.shape == (5, 1, 4, 8)
    for out, single in zip(outs, singles):
        # the same query over the same single timestep: the same value row
        assert np.allclose(out, single, atol=1e-6)
