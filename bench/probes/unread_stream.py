"""A /v1/stream peer that sends and does not read its replies: the server's
memory (VmRSS of the `attnserve serve` child) while it floods, and after it reads.

    python bench/probes/unread_stream.py [--frames 2000] [--max-in-flight N] [--context 64] [--ping-timeout S]
        [--adapter NAME] [--json-out F]

The flood: ``--frames`` attends of 64 rows (8/2 heads x 64; a reply is 128 KiB),
every tenth a one-row append instead, on one session, from a socket with a 64 KiB
receive window (tools/raw_stream.py). Phase one sends until the server takes no
byte for 3 s, or all; phase two reads every reply (answering the server's pings).
``--ping-timeout S`` sets the server's keepalive (a ping every S, S to answer it) and
``--context`` the rows the session holds before the flood: with the GPU work in
flight taking longer than the keepalive, a GPU slower than the keepalive."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _server import serving  # noqa: E402

from attnserve.config import Settings  # noqa: E402
from attnserve_client import Client  # noqa: E402
from tools.common import write_result  # noqa: E402
from tools.raw_stream import RawStream, flood  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=2000)
    p.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""), help="the server's ATTNSERVE_ADAPTER")
    p.add_argument("--max-in-flight", type=int, help="the server's ATTNSERVE_STREAM_MAX_IN_FLIGHT (default: its own)")
    p.add_argument("--context", type=int, default=64, help="rows in the session before the flood")
    p.add_argument("--ping-timeout", type=float, help="the server's keepalive interval and timeout, seconds")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    h, hkv, d, queries, every = 8, 2, 64, 64, 10
    rng = np.random.default_rng(0)
    env = {} if args.max_in_flight is None else {"ATTNSERVE_STREAM_MAX_IN_FLIGHT": str(args.max_in_flight)}
    if args.ping_timeout is not None:
        env["ATTNSERVE_STREAM_PING_INTERVAL_S"] = env["ATTNSERVE_STREAM_PING_TIMEOUT_S"] = str(args.ping_timeout)
    with serving(args.adapter, **env) as (server, url), Client(url) as client:
        port = int(url.rsplit(":", 1)[1])
        info_limit = args.max_in_flight or Settings.model_fields["stream_max_in_flight"].default
        s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
        s.append(0, *(rng.standard_normal((args.context, hkv, d)).astype("<f4") for _ in range(2)))
        with RawStream(port, timeout=600) as raw:  # a reply may wait for a slow step of 256 attends
            head = {"session_id": s.session_id, "layer": 0}
            docs = [
                doc for doc, _ in flood(head, rng, frames=args.frames, every=every, queries=queries, h=h, hkv=hkv, d=d)
            ]
            frames = raw.frames(docs)
            before = rss_mib(server.pid)
            t0 = time.monotonic()
            sent, part = raw.send_until_stalled(frames)
            time.sleep(2.0)  # what the server took finishes
            flooded = rss_mib(server.pid)
            taken = (s.info().lengths[0] - args.context) * every
            replies = raw.read_replies(args.frames, part, frames[sent + bool(part) :])
            after = rss_mib(server.pid)
            ok = sum(r["status"] == 200 for r in replies.values())
        doc = {
            "frames": args.frames,
            "max_in_flight": info_limit,
            "ping_interval_and_timeout_s": args.ping_timeout,
            "context": args.context,
            "reply_bytes": queries * h * d * 4,
            "frames_sent_before_stall": sent,
            "frame_bytes": max(map(len, frames)),
            "frames_taken_unread": taken,
            "rss_before_mib": round(before, 1),
            "rss_flooded_mib": round(flooded, 1),
            "rss_after_reading_mib": round(after, 1),
            "replies_ok": ok,
            "seconds": round(time.monotonic() - t0, 1),
        }
    print(doc)
    write_result(args.json_out, doc)
    return 0 if ok == args.frames else 1


if __name__ == "__main__":
    raise SystemExit(main())
