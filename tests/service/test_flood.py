"""A peer that sends and never reads, on each pipelined transport (/v1/stream, the
frame transport, shared memory), at two flood sizes, through bench/probes/flood.py
(a fresh `attnserve serve` per flood, raw peers: tools/raw_peers.py): the server
stops reading the connection after a bounded amount whatever the flood's size, its
host memory while flooded grows by a bounded amount that does not follow the
flood's size, its arenas stay within their setting, and once the peer reads every
reply comes (issue 52)."""

from __future__ import annotations

import json

import pytest

from script_helpers import run_script

MiB = 1 << 20
SIZES = (300, 1200)
ARENA_BUDGET = 8 * MiB


@pytest.fixture(scope="module")
def floods(tmp_path_factory):
    out = tmp_path_factory.mktemp("flood") / "flood.json"
    r = run_script(
        "bench/probes/flood.py",
        "--frames", ",".join(map(str, SIZES)),
        "--batch-arena-bytes", str(ARENA_BUDGET),
        "--json-out", str(out),
        timeout=1500,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {(f["transport"], f["frames"]): f for f in json.loads(out.read_text())["floods"]}


@pytest.mark.parametrize("transport", ["stream", "frames", "shm"])
def test_an_unread_flood_is_bounded_on_every_transport(floods, transport):
    small, large = (floods[transport, n] for n in SIZES)
    for f in (small, large):
        assert f["replies_ok"] == f["replies"] == f["frames"], f  # every reply, once the peer reads
        # the server stopped reading: it took a bounded part of the flood
        assert f["frames_sent_before_stall"] < SIZES[0], f
        # the arenas within their setting (six at it, two readback buffers at twice it)
        assert max(f["arenas_flooded"], f["arenas_after_reading"]) <= 10 * ARENA_BUDGET, f
        # the host's own buffers while flooded (on lavapipe the arenas are host memory too)
        arenas = max(f["arenas_flooded"] - f["arenas_before"], 0)
        assert f["rss_flooded"] - f["rss_before"] - arenas < 64 * MiB, f
    # what it took does not follow the flood's size
    assert abs(large["frames_sent_before_stall"] - small["frames_sent_before_stall"]) < SIZES[0] // 2, (small, large)
