#!/usr/bin/env python3
"""How much server CPU the bytes of a stacked step cost in each transport, with no
GPU and no attention: the floor under issue 25's "host cost per item".

    python bench/probes/step_transport.py [--items 64,256] [--steps 200] [--json-out FILE]

A stacked fused decode step moves, per item, a query row (32 heads x 128, float32:
16 KB) and a K and a V row (8 x 128: 4 KB each) in, and the output row (16 KB) out.
Each server below runs in a child process on 127.0.0.1 and answers every step with
an output of the right size; the client (this process) sends one step at a time and
waits for its answer. What is measured: steps/s, and the server process's CPU time
per step (user + system, from /proc), fitted as fixed + per item over ``--items``.

- ``websocket``: uvicorn (uvloop, websockets-sansio) and a Starlette WebSocket route,
  as ``/v1/stream`` is served: the frame arrives as ``bytes``, is unpacked with msgpack
  (the arrays' ``bin``), viewed with numpy, and the answer is packed with msgpack and
  sent (the server's own path minus the checks and the GPU).
- ``raw``: a length-prefixed binary framing on a plain asyncio socket
  (``asyncio.BufferedProtocol``): the frame is received into a preallocated buffer (a
  small msgpack header, then the arrays' bytes), the arrays are numpy views of that
  buffer, and the answer is one preallocated buffer (header, then the output bytes,
  copied in by numpy) handed to the transport: the design the next step of issue 25
  would build.

Traffic goes only to the loopback servers it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import numpy as np

H, HKV, D = 32, 8, 128
Q_BYTES, KV_BYTES = H * D * 4, HKV * D * 4

WEBSOCKET_APP = textwrap.dedent(
    """
    import msgpack, numpy as np
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocketDisconnect

    async def stream(ws):
        await ws.accept()
        while True:
            try:
                frame = await ws.receive_bytes()
            except WebSocketDisconnect:
                return
            doc = msgpack.unpackb(frame)
            q = np.frombuffer(doc["q"]["data"], "<f4").reshape(doc["q"]["shape"])
            for name in ("k", "v"):
                np.frombuffer(doc[name]["data"], "<f4")
            out = q  # the answer has the query's shape
            await ws.send_bytes(msgpack.packb({"out": {"dtype": "<f4", "shape": list(out.shape), "data": out.data.cast("B")},
                                               "lengths": [1] * out.shape[0], "errors": []}))

    app = Starlette(routes=[WebSocketRoute("/ws", stream)])
    """
)

RAW_SERVER = textwrap.dedent(
    """
    import asyncio, struct, sys, msgpack, numpy as np
    import uvloop

    class Step(asyncio.BufferedProtocol):
        def connection_made(self, transport):
            self.t = transport
            self.buf = bytearray(64 << 20)
            self.view = memoryview(self.buf)
            self.filled = 0
            self.out = bytearray(64 << 20)

        def get_buffer(self, sizehint):
            return self.view[self.filled:]

        def buffer_updated(self, n):
            self.filled += n
            while self.filled >= 8:
                hlen, total = struct.unpack_from("<II", self.buf, 0)
                if self.filled < 8 + total:
                    return
                head = msgpack.unpackb(self.view[8:8 + hlen])
                base = 8 + hlen
                arrays = {}
                for name, shape, off, nbytes in head["arrays"]:
                    arrays[name] = np.frombuffer(self.buf, "<f4", nbytes // 4, base + off).reshape(shape)
                q = arrays["q"]
                ans = msgpack.packb({"shape": list(q.shape), "lengths": [1] * q.shape[0], "errors": []})
                size = 8 + len(ans) + q.nbytes
                struct.pack_into("<II", self.out, 0, len(ans), size - 8)
                self.out[8:8 + len(ans)] = ans
                np.frombuffer(self.out, np.uint8, q.nbytes, 8 + len(ans))[:] = q.view(np.uint8).reshape(-1)
                self.t.write(memoryview(self.out)[:size])
                rest = self.filled - (8 + total)
                self.buf[:rest] = self.buf[8 + total:self.filled]
                self.filled = rest

    async def main(port):
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Step, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()

    uvloop.run(main(int(sys.argv[1])))
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_arrays(b: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "q": rng.standard_normal((b, 1, H, D)).astype("<f4"),
        "k": rng.standard_normal((b, 1, HKV, D)).astype("<f4"),
        "v": rng.standard_normal((b, 1, HKV, D)).astype("<f4"),
    }


def drive_websocket(port: int, b: int, steps: int, pid: int) -> dict[str, float]:
    from websockets.sync.client import connect

    arrays = step_arrays(b, np.random.default_rng(0))
    doc = {"session_ids": [f"s{i}" for i in range(b)], "layer": 0}
    doc.update({n: {"dtype": "<f4", "shape": list(a.shape), "data": a.data.cast("B")} for n, a in arrays.items()})
    with connect(f"ws://127.0.0.1:{port}/ws", max_size=None, compression=None) as ws:

        def one() -> None:
            ws.send(msgpack.packb(doc))
            answer = msgpack.unpackb(ws.recv())
            assert len(answer["out"]["data"]) == arrays["q"].nbytes

        return timed(one, steps, pid)


def drive_raw(port: int, b: int, steps: int, pid: int) -> dict[str, float]:
    arrays = step_arrays(b, np.random.default_rng(0))
    specs, off = [], 0
    for name, a in arrays.items():
        specs.append([name, list(a.shape), off, a.nbytes])
        off += a.nbytes
    head = msgpack.packb({"session_ids": [f"s{i}" for i in range(b)], "layer": 0, "arrays": specs})
    frame = struct.pack("<II", len(head), len(head) + off) + head + b"".join(a.tobytes() for a in arrays.values())
    buf = bytearray(64 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def one() -> None:
            s.sendall(frame)
            got = 0
            view = memoryview(buf)
            while got < 8 or got < 8 + struct.unpack_from("<II", buf, 0)[1]:
                got += s.recv_into(view[got:])
            hlen = struct.unpack_from("<II", buf, 0)[0]
            out = np.frombuffer(buf, "<f4", arrays["q"].size, 8 + hlen)
            assert out[0] == arrays["q"].reshape(-1)[0]

        return timed(one, steps, pid)


def timed(one, steps: int, pid: int) -> dict[str, float]:
    for _ in range(max(5, steps // 10)):
        one()
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    for _ in range(steps):
        one()
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return {"step_ms": round(wall / steps * 1e3, 3), "server_cpu_ms": round(cpu / steps * 1e3, 3)}


def start(kind: str, port: int) -> subprocess.Popen:
    if kind == "websocket":
        Path("/tmp/step_transport_app.py").write_text(WEBSOCKET_APP)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "/tmp"])))
        cmd = [sys.executable, "-m", "uvicorn", "step_transport_app:app", "--port", str(port), "--loop", "uvloop",
               "--ws", "websockets-sansio", "--ws-max-size", str(64 << 20), "--ws-per-message-deflate", "false",
               "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env)
    else:
        Path("/tmp/step_transport_raw.py").write_text(RAW_SERVER)
        proc = subprocess.Popen([sys.executable, "/tmp/step_transport_raw.py", str(port)], stdout=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the {kind} server did not start")


def fit(items: list[int], values: list[float]) -> dict[str, float]:
    slope, fixed = np.polyfit(np.asarray(items, float), np.asarray(values, float), 1)
    return {"fixed_ms": round(float(fixed), 3), "per_item_us": round(float(slope) * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", default="64,256", help="items per step (two or more for the fit)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    items = [int(x) for x in args.items.split(",")]
    result: dict[str, object] = {"probe": "step_transport", "items": items, "steps": args.steps}
    for kind, drive in (("websocket", drive_websocket), ("raw", drive_raw)):
        port = free_port()
        proc = start(kind, port)
        try:
            rows = [{"items": b, **drive(port, b, args.steps, proc.pid)} for b in items]
        finally:
            proc.kill()
            proc.wait()
        result[kind] = {
            "rows": rows,
            "server_cpu": fit(items, [r["server_cpu_ms"] for r in rows]) if len(items) > 1 else None,
        }
        print(json.dumps({kind: result[kind]}))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
