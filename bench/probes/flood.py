"""Floods of the pipelined transports by peers that send and never read: the
server's memory at each flood size, and every reply once the peer reads (issue 52).

    python bench/probes/flood.py [--transports stream,frames,shm] [--frames 600,1500,4000,10000]
        [--adapter NAME] [--batch-arena-bytes SIZE] [--json-out F]

For each transport and flood size, a fresh ``attnserve serve`` of this checkout (the
frame and shared-memory transports on), a one-layer session of 8 query / 2 KV heads
of 64 holding 64 rows, a warm-up flood of 100 frames read as they come, then the
flood (tools/flood.py: 64-row attends, a 128 KiB reply each, every tenth a one-row
append; sent unread until the server takes no byte for 3 s, then every reply read).
The peers are raw sockets (tools/raw_peers.py): the WebSocket's framing by the
``websockets`` library, the frames' and the region's by hand. Prints a line per
flood and the growth of the server's resident set, of its arenas and of the host's
own buffers (on lavapipe the arenas are host memory: the resident set's growth less
the arenas')."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _server import free_port, serving  # noqa: E402

from attnserve_client import Client  # noqa: E402
from tools.common import write_result  # noqa: E402
from tools.flood import SHAPE, flood_once, growth  # noqa: E402
from tools.raw_peers import open_peer  # noqa: E402

MiB = 1 << 20


class _Where:
    def __init__(self, url: str, frames_port: int, shm_socket: str):
        self.port = int(url.rsplit(":", 1)[1])
        self.frames_port, self.shm_socket = frames_port, shm_socket


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="stream,frames,shm")
    p.add_argument("--frames", default="600,1500,4000,10000", help="flood sizes, separated by commas")
    p.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""), help="the server's ATTNSERVE_ADAPTER")
    p.add_argument("--batch-arena-bytes", help="the server's ATTNSERVE_BATCH_ARENA_BYTES (default: its own)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    h, hkv, d, queries, _ = SHAPE
    rows = []
    for transport in args.transports.split(","):
        for frames in map(int, args.frames.split(",")):
            rng = np.random.default_rng(frames)
            with tempfile.TemporaryDirectory() as tmp:
                env = {
                    "ATTNSERVE_FRAMES_PORT": str(free_port()),
                    "ATTNSERVE_SHM_SOCKET": f"{tmp}/shm.sock",
                    "ATTNSERVE_WARMUP": "none",  # the warm-up flood compiles what the flood runs
                }
                if args.batch_arena_bytes:
                    env["ATTNSERVE_BATCH_ARENA_BYTES"] = args.batch_arena_bytes
                with serving(args.adapter, **env) as (server, url), Client(url) as client:
                    info = client.info()
                    arenas_in_rss = info["adapter"].get("adapter_type", "").lower() == "cpu"
                    s = client.create_session(num_qo_heads=h, num_kv_heads=hkv, head_dim=d)
                    s.append(0, *(rng.standard_normal((queries, hkv, d)).astype("<f4") for _ in range(2)))
                    where = _Where(url, int(env["ATTNSERVE_FRAMES_PORT"]), env["ATTNSERVE_SHM_SOCKET"])
                    with open_peer(transport, where, timeout=600) as peer:
                        flood_once(peer, client, s, server.pid, 100, rng)  # the warm-up
                        m = flood_once(peer, client, s, server.pid, frames, rng)
            g = growth(m, arenas_in_rss)
            row = {"transport": transport, "adapter": info["adapter"].get("name"), **m,
                   **{f"growth_{k}_mib": round(v / MiB, 1) for k, v in g.items()}}  # fmt: skip
            rows.append(row)
            print(
                f"{transport:6} {frames:6} frames: sent {m['frames_sent_before_stall']} before the stall, "
                f"unread: RSS +{(m['rss_flooded'] - m['rss_before']) / MiB:.1f} MiB; at the peak, unread or "
                f"read: RSS +{g['rss'] / MiB:.1f} MiB, arenas +{g['arenas'] / MiB:.1f} MiB, host buffers "
                f"+{g['host'] / MiB:.1f} MiB; replies {m['replies_ok']}/{frames} ok in {m['seconds']} s",
                flush=True,
            )
    write_result(args.json_out, {"floods": rows})
    return 0 if all(r["replies_ok"] == r["frames"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
