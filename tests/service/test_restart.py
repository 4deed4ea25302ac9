"""Restarts that lose nothing (ATTNSERVE_SNAPSHOT_DIR): shutdown writes every
session's snapshot atomically, the next start restores them (owners included)
before it is ready; bad files are moved aside; deleted and expired sessions
lose their files. The last test kills (SIGTERM) a real server process in the
middle of a load and checks, after a restart, every session against the float64
oracle (f32) or bit for bit against its answers before the restart (TurboQuant),
and that no request that failed during the drain was applied."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from attnserve import persistence
from attnserve.auth import key_id
from attnserve.config import Settings
from attnserve.persistence import SnapshotDir, decode_file
from attnserve_client import wire
from svc_helpers import F32_TOL, Api, LiveServer, Model, free_port, from_wire, rel_err, rows

KEY_A = "restart-a-0123456789abcdef"
KEY_B = "restart-b-fedcba9876543210"
ROOT = Path(__file__).resolve().parents[2]


def _api(url: str, key: str | None) -> Api:
    api = Api(url)
    if key:
        api.client.headers["Authorization"] = f"Bearer {key}"
    return api


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}")


# ── in process: the files ────────────────────────────────────────────────────


PROGRESS_FIELDS = ("sessions", "sessions_done", "bytes", "bytes_done", "bytes_per_second", "eta_seconds", "seconds")


def _progress(caplog, phase: str) -> list[dict]:
    """The save or restore's log lines: started, progress..., and the last one."""
    last = {"save": "snapshots written", "restore": "snapshots restored"}[phase]
    return [
        {"msg": r.getMessage(), **{k: v for k, v in r.__dict__.items() if k in PROGRESS_FIELDS}}
        for r in caplog.records
        if r.name == "attnserve.persistence"
        and r.getMessage() in (f"snapshot {phase} started", f"snapshot {phase} progress", last)
    ]


def test_shutdown_writes_and_start_restores(engine, tmp_path, rng, caplog, monkeypatch):
    monkeypatch.setattr(persistence, "PROGRESS_INTERVAL_S", 0.0)  # a progress line after every session
    caplog.set_level(logging.INFO, logger="attnserve.persistence")
    settings = Settings(api_keys=f"{KEY_A},{KEY_B}", snapshot_dir=str(tmp_path))
    srv = LiveServer(settings, engine=engine).start()
    a, b = _api(srv.url, KEY_A), _api(srv.url, KEY_B)
    sessions = {  # (api, id) -> (shape, model or None)
        (a, "f32"): (dict(num_qo_heads=4, num_kv_heads=2, head_dim=32, num_layers=2), Model(4, 2, 32, 2)),
        (a, "tq"): (dict(num_qo_heads=4, num_kv_heads=1, head_dim=64, num_layers=2, kv_format="turboquant"), None),
        (b, "f32"): (dict(num_qo_heads=2, num_kv_heads=2, head_dim=16), Model(2, 2, 16)),  # same id, B's own
        (b, "empty"): (dict(num_qo_heads=2, num_kv_heads=1, head_dim=8, num_layers=3), None),
    }
    before = {}
    for (api, sid), (shape, model) in sessions.items():
        api.create(session_id=sid, **shape)
        if sid == "empty":
            continue
        hkv, d, h = shape["num_kv_heads"], shape["head_dim"], shape["num_qo_heads"]
        for layer in range(shape.get("num_layers", 1)):
            k, v = rows(rng, 70 + layer, hkv, d), rows(rng, 70 + layer, hkv, d)
            assert api.append(sid, layer, k, v).status == 200
            if model:
                model.add(layer, k, v)
            q = rows(rng, 3, h, d)
            before[(id(api), sid, layer)] = (q, api.attend(sid, layer, q).body["out"])
    gone = a.create(session_id="deleted", num_qo_heads=1, num_kv_heads=1, head_dim=4)["session_id"]
    assert a.delete(gone).status == 204
    infos = {(id(api), sid): api.info(sid) for api, sid in sessions}
    srv.stop()

    names = sorted(p.name for p in tmp_path.iterdir())
    ka, kb = key_id(KEY_A), key_id(KEY_B)
    sizes = sorted(p.stat().st_size for p in tmp_path.glob("*.snap"))
    # the save logged how far it was after each session: sessions and bytes done, the rate
    lines = _progress(caplog, "save")
    assert [x["msg"] for x in lines] == ["snapshot save started"] + ["snapshot save progress"] * 3 + [
        "snapshots written"
    ]
    assert lines[0]["sessions"] == 4
    assert [x["sessions_done"] for x in lines[1:]] == [1, 2, 3, 4]
    done = [x["bytes_done"] for x in lines[1:]]
    assert done == sorted(done) and done[-1] == sum(sizes) and all(x["bytes_per_second"] > 0 for x in lines[1:])
    caplog.clear()
    assert names == sorted([".lock", f"{ka}.f32.snap", f"{ka}.tq.snap", f"{kb}.f32.snap", f"{kb}.empty.snap"])
    sid, owner, blob = decode_file((tmp_path / f"{ka}.tq.snap").read_bytes())
    assert (sid, owner) == ("tq", ka) and wire.unpackb(blob, max_bytes=1 << 30)["config"]["kv_format"] == "turboquant"
    assert KEY_A.encode() not in (tmp_path / f"{ka}.tq.snap").read_bytes()
    # what a crash or a bad disk may leave: a partial temporary file, junk, a truncated
    # file, a file whose header was altered (another owner): moved aside, never restored
    good = (tmp_path / f"{ka}.f32.snap").read_bytes()
    (tmp_path / f".{ka}.f32.snap.123.tmp").write_bytes(good[:100])
    (tmp_path / "junk.snap").write_bytes(b"not a snapshot")
    (tmp_path / "truncated.snap").write_bytes(good[: len(good) // 2])
    (tmp_path / "forged.snap").write_bytes(good.replace(ka.encode(), kb.encode(), 1))

    srv = LiveServer(settings, engine=engine).start()
    try:
        a, b = _api(srv.url, KEY_A), _api(srv.url, KEY_B)
        for (api0, sid), (shape, model) in sessions.items():
            api = a if api0.client.headers["Authorization"].endswith(KEY_A) else b
            assert api.info(sid) == infos[(id(api0), sid)]
            for layer in range(shape.get("num_layers", 1)):
                if (id(api0), sid, layer) not in before:
                    continue
                q, out = before[(id(api0), sid, layer)]
                got = api.attend(sid, layer, q).body["out"]
                assert got.tobytes() == out.tobytes()  # bit-identical to before the restart
                if model:
                    assert rel_err(got, model.attention(layer, q)) <= F32_TOL
        assert a.call("GET", "/v1/sessions/empty").status == 404  # B's, invisible to A
        assert a.call("GET", "/v1/sessions/deleted").status == 404
        names = sorted(p.name for p in tmp_path.iterdir())
        assert "junk.snap.bad" in names and "truncated.snap.bad" in names and "forged.snap.bad" in names
        assert not [n for n in names if n.endswith(".tmp")]
        assert _metric(srv.url, 'attnserve_snapshot_restores_total{result="ok"}') == 4
        assert _metric(srv.url, 'attnserve_snapshot_restores_total{result="invalid"}') == 3
        # the restore logged its progress over the 7 files: 4 good, 3 moved aside
        lines = _progress(caplog, "restore")
        assert [x["msg"] for x in lines] == ["snapshot restore started"] + ["snapshot restore progress"] * 6 + [
            "snapshots restored"
        ]
        total = sum(sizes) + sum(len(x) for x in (b"not a snapshot", good[: len(good) // 2], good))
        assert lines[0]["sessions"] == 7 and lines[0]["bytes"] == total
        assert [x["sessions_done"] for x in lines[1:]] == list(range(1, 8))
        assert lines[-1]["bytes_done"] == total and lines[-1]["bytes_per_second"] > 0
        assert all(x["eta_seconds"] >= 0 for x in lines[1:-1]) and "eta_seconds" not in lines[-1]
        assert a.call("GET", "/v1/info").body["persistence"] is True
        # a second server cannot take the same directory
        with pytest.raises(RuntimeError, match="in use"):
            SnapshotDir(tmp_path, srv.runtime).open()
        # DELETE removes the session's file at once
        assert a.delete("tq").status == 204
        assert not (tmp_path / f"{ka}.tq.snap").exists() and (tmp_path / f"{ka}.f32.snap").exists()
    finally:
        srv.stop()

    # expiry removes the files too
    srv = LiveServer(
        Settings(api_keys=f"{KEY_A},{KEY_B}", snapshot_dir=str(tmp_path), session_ttl_seconds=0.3), engine=engine
    ).start()
    try:
        deadline = time.monotonic() + 10
        while list(tmp_path.glob("*.snap")):
            assert time.monotonic() < deadline, list(tmp_path.glob("*.snap"))
            time.sleep(0.05)
        assert _metric(srv.url, "attnserve_sessions_expired_total") == 3
    finally:
        srv.stop()
    assert not list(tmp_path.glob("*.snap"))


# ── a real process, SIGTERM in the middle of a load ─────────────────────────


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_") or k == "ATTNSERVE_ADAPTER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "service"), str(ROOT / "client"), env.get("PYTHONPATH", "")])
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    env.update(extra)
    return env


def _start(port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve", "--port", str(port)], cwd=ROOT, env=env, stdout=f, stderr=f
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become ready")


class Load(threading.Thread):
    """Decode steps on one session, round-robin over its layers: fused attends with
    ``offset``, until the server is gone. Keeps what was acknowledged."""

    def __init__(self, url: str, key: str, sid: str, shape: dict, model: Model, seed: int):
        super().__init__(daemon=True)
        self.url, self.key, self.sid, self.shape, self.model = url, key, sid, shape, model
        self.rng = np.random.default_rng(seed)
        self.last: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (q, out) of its last step
        self.statuses: list[int] = []  # non-200 answers
        self.transport_errors = 0
        self.acked = 0
        self.bad: list[str] = []

    def run(self) -> None:
        h, hkv, d, layers = (self.shape[k] for k in ("num_qo_heads", "num_kv_heads", "head_dim", "num_layers"))
        client = httpx.Client(
            base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {self.key}", "Content-Type": wire.MSGPACK}
        )
        step = 0
        while True:
            layer = step % layers
            q, k, v = rows(self.rng, 1, h, d), rows(self.rng, 1, hkv, d), rows(self.rng, 1, hkv, d)
            body = {
                "q": wire.encode_array(q),
                "k": wire.encode_array(k),
                "v": wire.encode_array(v),
                "offset": self.model.lengths[layer],
            }
            try:
                r = client.post(f"/v1/sessions/{self.sid}/layers/{layer}/attend", content=wire.packb(body))
            except httpx.ConnectError:
                break  # the server is gone
            except httpx.TransportError:
                self.transport_errors += 1
                time.sleep(0.02)
                continue
            if r.status_code != 200:
                self.statuses.append(r.status_code)
                if r.status_code != 503 or r.json()["type"] != "/problems/not-ready":
                    self.bad.append(r.text)
                time.sleep(0.02)
                continue
            res = from_wire(wire.unpackb(r.content, max_bytes=1 << 30))
            self.model.add(layer, k, v)
            out = np.asarray(res["out"], np.float32)
            if res["length"] != self.model.lengths[layer]:
                self.bad.append(f"length {res['length']} != {self.model.lengths[layer]}")
            if self.shape["kv_format"] == "f32" and rel_err(out, self.model.attention(layer, q)) > F32_TOL:
                self.bad.append(f"step {step}: f32 output off the oracle")
            self.last[layer] = (q, out)
            self.acked += 1
            step += 1
        client.close()


SESSIONS = [  # key, id, shape
    (KEY_A, "shared", dict(kv_format="f32", num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32)),
    (KEY_B, "shared", dict(kv_format="turboquant", num_layers=2, num_qo_heads=4, num_kv_heads=1, head_dim=64)),
    (KEY_A, "tq-a", dict(kv_format="turboquant", num_layers=3, num_qo_heads=8, num_kv_heads=2, head_dim=32)),
    (KEY_B, "f32-b", dict(kv_format="f32", num_layers=3, num_qo_heads=2, num_kv_heads=1, head_dim=64)),
]


@pytest.mark.usefixtures("engine")  # needs an adapter: skips without one, fails under CI
def test_sigterm_mid_load_then_restart_loses_nothing(tmp_path, rng):
    snapdir, log = tmp_path / "snapshots", tmp_path / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _env(
        ATTNSERVE_SNAPSHOT_DIR=str(snapdir),
        ATTNSERVE_API_KEYS=f"{KEY_A},{KEY_B}",
        ATTNSERVE_DRAIN_DELAY_S="1.0",
        ATTNSERVE_MAX_BATCH_JOBS="8",
        ATTNSERVE_WARMUP="none",  # not what is tested here: both starts stay quick
    )
    proc = _start(port, env, log)
    loads = []
    try:
        for i, (key, sid, shape) in enumerate(SESSIONS):
            api = _api(url, key)
            api.create(session_id=sid, max_tokens=4096, **shape)
            model = Model(shape["num_qo_heads"], shape["num_kv_heads"], shape["head_dim"], shape["num_layers"])
            for layer in range(shape["num_layers"]):
                k, v = (rows(rng, 40 + 7 * layer, shape["num_kv_heads"], shape["head_dim"]) for _ in range(2))
                assert api.append(sid, layer, k, v, offset=0).status == 200
                model.add(layer, k, v)
            api.close()
            loads.append(Load(url, key, sid, shape, model, seed=int(rng.integers(1 << 31))))
        for t in loads:
            t.start()
        deadline = time.monotonic() + 60
        while min(t.acked for t in loads) < 8:
            assert time.monotonic() < deadline and all(t.is_alive() for t in loads)
            time.sleep(0.05)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        saw_not_ready = False
        while time.monotonic() - t_term < 0.8:
            try:
                r = httpx.get(url + "/readyz", timeout=1)
            except httpx.TransportError:
                break
            if r.status_code == 503:
                saw_not_ready = True
                assert httpx.get(url + "/livez", timeout=1).status_code == 200
                break
            time.sleep(0.02)
        assert saw_not_ready
        # uvicorn re-raises the signal once it has shut down: exit status -SIGTERM
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        t_exit = time.monotonic()
        for t in loads:
            t.join(timeout=60)
            assert not t.is_alive()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert '"msg":"stopped"' in text
    assert "snapshots written" in text and '"error":0' in text.split("snapshots written", 1)[1][:200]
    assert f'"msg":"snapshot save started","sessions":{len(SESSIONS)}' in text
    assert '"bytes_per_second":' in text.split("snapshots written", 1)[1].split("\n", 1)[0]
    files = sorted(p.name for p in snapdir.glob("*.snap"))
    assert len(files) == len(SESSIONS) and not list(snapdir.glob(".*.tmp"))
    for t in loads:
        assert not t.bad, t.bad[:3]
        assert t.statuses and set(t.statuses) == {503}  # refused while draining, cleanly

    t_start = time.monotonic()
    proc = _start(port, env, log)
    restart_s = time.monotonic() - t_start
    try:
        assert _metric(url, 'attnserve_snapshot_restores_total{result="ok"}') == len(SESSIONS)
        for t in loads:
            api = _api(url, t.key)
            # nothing that failed during the drain was applied; everything acknowledged is there
            assert api.info(t.sid)["lengths"] == t.model.lengths
            shape = t.shape
            for layer in range(shape["num_layers"]):
                if layer in t.last:  # the last acknowledged step, asked again: the same answer
                    q, out = t.last[layer]
                    r = api.attend(t.sid, layer, q)
                    assert r.status == 200 and r.body["length"] == t.model.lengths[layer]
                    if shape["kv_format"] == "f32":
                        assert rel_err(r.body["out"], t.model.attention(layer, q)) <= F32_TOL
                    else:
                        assert r.body["out"].tobytes() == out.tobytes()
                if shape["kv_format"] == "f32":  # every row of the cache, against the oracle
                    q = rows(rng, 16, shape["num_qo_heads"], shape["head_dim"])
                    r = api.attend(t.sid, layer, q, start_pos=0, causal=False)
                    assert rel_err(r.body["out"], t.model.attention(layer, q, start_pos=0, causal=False)) <= F32_TOL
            api.close()
        # the load goes on after the restart, still right
        later = [Load(url, t.key, t.sid, t.shape, t.model, seed=int(rng.integers(1 << 31))) for t in loads]
        for t in later:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        for t in later:
            t.join(timeout=60)
            assert not t.bad, t.bad[:3]
            assert t.acked > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps = sum(t.acked for t in loads)
    refused = sum(len(t.statuses) for t in loads)
    print(
        f"\nrestart: {steps} steps acknowledged before SIGTERM, {refused} refused with 503 while draining, "
        f"{sum(t.transport_errors for t in loads)} transport errors; SIGTERM to exit "
        f"{t_exit - t_term:.2f} s (1.0 s drain delay); start with restore {restart_s:.2f} s"
    )
