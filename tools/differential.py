#!/usr/bin/env python3
"""Differential check of two trees of the service: the same seeded random mix of
appends and attends, good and bad, sent to a server of each tree through every
form (the routes, ``POST /v1/batch/attend`` in its items and stacked forms, and
the same operations as ``/v1/stream`` frames), compared answer by answer: the
status, every member of the body (arrays bit for bit, problem details verbatim)
and each session's info after every request.

    python tools/differential.py --old /path/to/old/tree [--new .] [--ops 400] [--seed 1]
        [--budget-bytes N] [--json-out FILE]

Each tree's server is started as ``python -m attnserve serve`` with that tree's
``service/`` and ``client/`` on its path (warm-up off, ``127.0.0.1``, a free port;
``--budget-bytes`` sets both servers' memory budget, so budget refusals are in
the mix). Exits 1 at the first difference, printing the operation and both
answers; 0 when every answer agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT)]

from attnserve_client.wire import decode_array, encode_array  # noqa: E402
from tools.common import free_port, write_result  # noqa: E402

MSGPACK = "application/msgpack"
FORMATS = ["f32", "f16", "turboquant", "tq4", "tq2o"]


class Server:
    """``python -m attnserve serve`` of one tree, on a free port."""

    def __init__(self, tree: Path, budget: int, log: Path):
        self.tree, self.port = tree, free_port()
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(tree / "service"), str(tree / "client"), str(tree)]),
            ATTNSERVE_WARMUP="none",
            ATTNSERVE_HOST="127.0.0.1",
            ATTNSERVE_PORT=str(self.port),
            ATTNSERVE_MEMORY_BUDGET_BYTES=str(budget),
            ATTNSERVE_LOG_LEVEL="warning",
        )
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve"], cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server of {tree} exited ({self.proc.returncode}); see {log}")
            try:
                if self.http.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the server of {tree} was not ready in 180 s; see {log}")

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"accept": MSGPACK}
        content = None
        if body is not None:
            content, headers["content-type"] = msgpack.packb(body, use_bin_type=True), MSGPACK
        r = self.http.request(method, path, content=content, headers=headers)
        return r.status_code, _decoded(r.content, r.headers.get("content-type", ""))

    def stream(self, frames: list[dict[str, Any]]) -> list[Any]:
        """The frames sent on one ``/v1/stream`` connection; the replies in id order."""
        from websockets.sync.client import connect

        with connect(f"ws://127.0.0.1:{self.port}/v1/stream", max_size=None) as ws:
            for frame in frames:
                ws.send(msgpack.packb(frame, use_bin_type=True))
            replies = [_plain(msgpack.unpackb(ws.recv(), raw=False)) for _ in frames]
        return sorted(replies, key=lambda r: r["id"])

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _decoded(content: bytes, kind: str) -> Any:
    if not content:
        return None
    if "msgpack" in kind:
        return _plain(msgpack.unpackb(content, raw=False))
    return json.loads(content)


def _plain(doc: Any) -> Any:
    """A decoded answer with its arrays as (dtype, shape, bytes): compared bit for bit."""
    if isinstance(doc, dict):
        if {"dtype", "shape", "data"} <= set(doc):
            a = decode_array(doc, name="answer", ndim=len(doc["shape"]), finite=False)
            return ("array", str(a.dtype), list(a.shape), a.tobytes())
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    return doc


class Mix:
    """The seeded random operations, made once and sent to both servers alike."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.sessions: dict[str, dict[str, Any]] = {}

    def arr(self, *shape: int, scale: float = 1.0) -> dict[str, Any]:
        return encode_array((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def session(self, i: int) -> tuple[str, dict[str, Any]]:
        r = self.rng
        fmt = FORMATS[i % len(FORMATS)]
        h, hkv, d = [(4, 2, 32), (6, 3, 32), (4, 4, 32)][i % 3]
        body: dict[str, Any] = {
            "num_layers": 2, "num_qo_heads": h, "num_kv_heads": hkv, "head_dim": d, "kv_format": fmt,
            "max_tokens": int(r.choice([64, 4096])), "seed": i,
        }  # fmt: skip
        if fmt in ("tq4", "turboquant") and r.random() < 0.5:
            body.update(sinks=int(r.integers(0, 4)), window=int(r.integers(1, 20)))
        sid = f"s{i}"
        self.sessions[sid] = body
        return sid, body

    def op(self, sid: str) -> dict[str, Any]:
        """One operation on ``sid`` (an attend, maybe fused, or an append), maybe bad."""
        r, cfg = self.rng, self.sessions.get(sid, self.sessions["s0"])
        h, hkv, d = cfg["num_qo_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        layer = int(r.integers(0, 2)) if r.random() < 0.95 else int(r.choice([2, 7]))
        n, m = int(r.choice([1, 1, 2, 5])), int(r.choice([0, 1, 1, 3]))
        doc: dict[str, Any] = {"session_id": sid, "layer": layer}
        bad = r.random()
        scale = 1e5 if bad < 0.04 else 1.0  # past f16's range, or a TurboQuant norm's
        if r.random() < 0.25:  # an append
            m = max(m, 1)
            doc.update(op="append", k=self.arr(m, hkv, d, scale=scale), v=self.arr(m, hkv, d))
        else:
            doc.update(op="attend", q=self.arr(n, h, d))
            if m:
                doc.update(k=self.arr(m, hkv, d, scale=scale), v=self.arr(m, hkv, d))
            if r.random() < 0.2:
                doc["start_pos"] = int(r.integers(0, 30))
            if r.random() < 0.1:
                doc["causal"] = False
            if r.random() < 0.15:
                doc["return_lse"] = True
        if r.random() < 0.1:
            doc["offset"] = int(r.integers(0, 20))
        if 0.04 <= bad < 0.06:
            doc["q" if "q" in doc else "k"] = self.arr(1, h + 1, d)  # a wrong shape
        elif 0.06 <= bad < 0.07 and "k" in doc:
            doc["k"] = doc["v"] = self.arr(m, hkv + 1, d)  # k and v of the wrong shape
        elif 0.07 <= bad < 0.09:
            doc["bogus"] = 1  # an unknown member
        return doc


def _route(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body = {k: v for k, v in doc.items() if k not in ("op", "session_id", "layer")}
    kind = "kv" if doc["op"] == "append" else "attend"
    return f"/v1/sessions/{doc['session_id']}/layers/{doc['layer']}/{kind}", body


def _stacked(mix: Mix, ids: list[str]) -> dict[str, Any]:
    """A stacked step on ``ids`` (the decode shape of ``s0``'s family: 4 q / 2 KV heads of 32)."""
    r, b = mix.rng, len(ids)
    layer = int(r.integers(0, 2)) if r.random() < 0.95 else 2
    doc: dict[str, Any] = {"session_ids": ids, "layer": layer, "q": mix.arr(b, 1, 4, 32)}
    if r.random() < 0.8:
        doc.update(k=mix.arr(b, 1, 2, 32), v=mix.arr(b, 1, 2, 32))
    if r.random() < 0.2:
        doc["offsets"] = [None if r.random() < 0.5 else int(r.integers(0, 10)) for _ in ids]
    if r.random() < 0.2:
        doc["return_lse"] = True
    return doc


def run(old: Path, new: Path, ops: int, seed: int, budget: int, logs: Path) -> dict[str, Any]:
    servers = [Server(old, budget, logs / "old.log"), Server(new, budget, logs / "new.log")]
    compared = {"route": 0, "items": 0, "stacked": 0, "stream": 0, "info": 0}
    try:
        mix = Mix(seed)
        for i in range(12):
            sid, body = mix.session(i)
            _same("create", [s.call("PUT", f"/v1/sessions/{sid}", body) for s in servers])
        family = [sid for sid, c in mix.sessions.items() if (c["num_qo_heads"], c["head_dim"]) == (4, 32)]

        def pick_id(pool: list[str]) -> str:  # now and then one that does not exist
            return "nope" if mix.rng.random() < 0.04 else str(mix.rng.choice(pool))

        ids = list(mix.sessions)
        done = 0
        while done < ops:
            r = mix.rng.random()
            if r < 0.4:
                doc = mix.op(pick_id(ids))
                what, answers = "route", [s.call("POST", *_route(doc)) for s in servers]
            elif r < 0.6:
                items = []
                for _ in range(int(mix.rng.integers(1, 7))):
                    item = mix.op(pick_id(ids))
                    if item.pop("op") == "append":  # an item is an attend: an append's rows fused with a query
                        cfg = mix.sessions.get(item["session_id"], mix.sessions["s0"])
                        item["q"] = mix.arr(1, cfg["num_qo_heads"], cfg["head_dim"])
                    items.append(item)
                what, answers = "items", [s.call("POST", "/v1/batch/attend", {"items": items}) for s in servers]
            elif r < 0.8:
                pick = [pick_id(family) for _ in range(int(mix.rng.integers(1, 6)))]
                doc = _stacked(mix, pick)
                what, answers = "stacked", [s.call("POST", "/v1/batch/attend", doc) for s in servers]
            else:
                frames = []
                for j in range(int(mix.rng.integers(1, 6))):
                    if mix.rng.random() < 0.2:
                        pick = [pick_id(family) for _ in range(int(mix.rng.integers(1, 4)))]
                        frame = {"op": "attend_batch", **_stacked(mix, pick)}
                    else:
                        frame = mix.op(pick_id(ids))
                    frames.append({"id": j, **frame})
                what, answers = "stream", [s.stream(frames) for s in servers]
            _same(what, answers, seed=seed, step=done)
            compared[what] += 1
            done += 1
            if done % 10 == 0:
                for sid in mix.sessions:
                    _same("info", [s.call("GET", f"/v1/sessions/{sid}") for s in servers])
                    compared["info"] += 1
    finally:
        for s in servers:
            s.close()
    return compared


#: What the compared answers held: answers (200) and problems, by type (items and frames each counted).
TALLY: dict[str, int] = {}


def _tally(doc: Any) -> None:
    if isinstance(doc, dict):
        if "type" in doc and "status" in doc and "detail" in doc:  # a problem
            key = str(doc["type"]).rsplit("/", 1)[-1]
            TALLY[key] = TALLY.get(key, 0) + 1
            return
        if "out" in doc or "length" in doc:
            TALLY["answered"] = TALLY.get("answered", 0) + 1
        for v in doc.values():
            _tally(v)
    elif isinstance(doc, (list, tuple)):
        for v in doc:
            _tally(v)


def _same(what: str, answers: list[Any], **where: Any) -> None:
    if what != "info":
        _tally(answers[0])
    if answers[0] != answers[1]:
        print(f"DIFFERENT {what} {where}:\n old: {answers[0]!r:.3000}\n new: {answers[1]!r:.3000}", file=sys.stderr)
        raise SystemExit(1)


def _commit(tree: Path) -> str:
    """The tree's commit (``+dirty`` with uncommitted changes), or its path outside git."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return str(tree)
    if head.returncode:
        return str(tree)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="the tree answers are compared against")
    ap.add_argument("--new", type=Path, default=ROOT, help="the tree under test (default: this checkout)")
    ap.add_argument("--ops", type=int, default=400, help="requests in the mix (default 400)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-bytes", type=int, default=0, help="both servers' memory budget (0: none)")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"), help="where the servers' logs go")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    t0 = time.monotonic()
    compared = run(a.old.resolve(), a.new.resolve(), a.ops, a.seed, a.budget_bytes, a.logs)
    doc = {"old": _commit(a.old), "new": _commit(a.new), "date": time.strftime("%Y-%m-%d"), "seed": a.seed,
           "ops": a.ops, "budget_bytes": a.budget_bytes,
           "compared": compared, "outcomes": dict(sorted(TALLY.items())), "differences": 0,
           "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
    print(json.dumps(doc))
    write_result(a.json_out, doc)


if __name__ == "__main__":
    main()
