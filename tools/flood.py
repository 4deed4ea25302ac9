"""A flood of a pipelined transport by a peer that sends and does not read: what it
costs the server's memory, and whether every reply comes once the peer reads. The
measure of tests/service/test_flood.py and bench/probes/flood.py (issue 52).

A flood is ``frames`` attends of 64 rows on one session (8 query / 2 KV heads of 64:
a reply is 128 KiB), every tenth a one-row append instead (:func:`tools.raw_peers.flood`),
from a raw peer with a 64 KiB receive window. Phase one sends them reading nothing
until the server takes no byte for 3 s (or all are sent) and the frames it took
have finished; phase two reads every reply while sending the rest. Memory is the
server process's resident set (``VmRSS``) and the GPU worker's arenas (``GET
/v1/info``'s ``arenas``): on an adapter whose device memory is host memory
(lavapipe) the arenas are part of the resident set, so the host's own buffers are
the resident set's growth less the arenas'."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from tools.raw_peers import RawPeer, flood

__all__ = ["SHAPE", "rss_bytes", "flood_once", "growth"]

#: (query heads, KV heads, head_dim, query rows of an attend, one append every this many frames)
SHAPE = (8, 2, 64, 64, 10)


def rss_bytes(pid: int) -> int:
    """The resident set of process ``pid`` (Linux: /proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def flood_once(
    peer: RawPeer, client: Any, session: Any, pid: int, frames: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Flood ``session`` (a client Session, of :data:`SHAPE`, one layer) through
    ``peer`` with ``frames`` frames, unread, then read every reply. ``client`` (a
    sync Client of the same server) reads its info, ``pid`` is the server's process.
    Returns the measures: bytes of the resident set and the arenas before, once the
    server stopped taking frames, and after every reply was read; frames sent
    before the stall; replies with status 200 (of ``frames``)."""
    h, hkv, d, queries, every = SHAPE
    head = {"session_id": session.session_id, "layer": 0}
    out = peer.frames(
        [doc for doc, _ in flood(head, rng, frames=frames, every=every, queries=queries, h=h, hkv=hkv, d=d)]
    )
    length0 = session.info().lengths[0]
    rss0, arenas0 = rss_bytes(pid), client.info()["arenas"]["bytes"]
    t0 = time.monotonic()
    sent, part = peer.send_until_stalled(out)
    taken = [-1]
    while True:  # the frames the server took finish; then it takes no more
        time.sleep(0.5)
        taken.append(session.info().lengths[0] - length0)
        if taken[-1] == taken[-2]:
            break
    rss1, arenas1 = rss_bytes(pid), client.info()["arenas"]["bytes"]
    replies = peer.read_replies(frames, part, out[sent + bool(part) :])
    rss2, arenas2 = rss_bytes(pid), client.info()["arenas"]["bytes"]
    return {
        "frames": frames,
        "reply_bytes": queries * h * d * 4,
        "frames_sent_before_stall": sent,
        "appends_taken_unread": taken[-1],
        "rss_before": rss0,
        "rss_flooded": rss1,
        "rss_after_reading": rss2,
        "arenas_before": arenas0,
        "arenas_flooded": arenas1,
        "arenas_after_reading": arenas2,
        "replies_ok": sum(r.get("status") == 200 for r in replies.values()),
        "replies": len(replies),
        "seconds": round(time.monotonic() - t0, 2),
    }


def growth(m: dict[str, Any], arenas_in_rss: bool) -> dict[str, int]:
    """A flood's growth in bytes, at its larger of flooded and after reading: of the
    resident set, of the arenas, and of the host's own buffers (the resident set's
    less the arenas' where the device's memory is host memory: ``arenas_in_rss``)."""
    rss = max(m["rss_flooded"], m["rss_after_reading"]) - m["rss_before"]
    arenas = max(m["arenas_flooded"], m["arenas_after_reading"]) - m["arenas_before"]
    return {"rss": rss, "arenas": arenas, "host": rss - max(arenas, 0) if arenas_in_rss else rss}
