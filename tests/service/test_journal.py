"""Incremental persistence (journal.py): a server killed with SIGKILL mid-load
restores, at its next start, every row acknowledged before its last journal sync
(in whole pages), exactly as the client sent it, and no layer has a torn row."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from attnserve import journal as J
from attnserve.kv.config import SessionConfig
from attnserve.pool import PageLayout
from attnserve_client import wire
from svc_helpers import F32_TOL, Api, Model, free_port, from_wire, rel_err, rows
from test_restart import _env, _start

P = 16  # the killed server's page_tokens: pages fill fast
SHAPES = {
    "f32-s": dict(kv_format="f32", num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32),
    "tq-s": dict(kv_format="turboquant", num_layers=2, num_qo_heads=4, num_kv_heads=1, head_dim=64),
    # per-layer formats: each layer's pages journaled in its own layout
    "mixed-s": dict(kv_format=["turboquant", "f32"], num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32),
    "half-s": dict(kv_format=["bf16", "f16"], num_layers=2, num_qo_heads=6, num_kv_heads=3, head_dim=40),
}


class Appender(threading.Thread):
    """Appends 1..6 rows at a time to every layer of one session, round-robin, until
    the server is gone; keeps every acknowledged row and when it was acknowledged."""

    def __init__(self, url: str, sid: str, shape: dict, seed: int):
        super().__init__(daemon=True)
        self.url, self.sid, self.shape = url, sid, shape
        self.rng = np.random.default_rng(seed)
        self.model = Model(shape["num_qo_heads"], shape["num_kv_heads"], shape["head_dim"], shape["num_layers"])
        self.acks: dict[int, list[tuple[float, int]]] = {i: [] for i in range(shape["num_layers"])}
        self.bad: list[str] = []

    def run(self) -> None:
        hkv, d, layers = self.shape["num_kv_heads"], self.shape["head_dim"], self.shape["num_layers"]
        client = httpx.Client(base_url=self.url, timeout=30, headers={"Content-Type": wire.MSGPACK})
        step = 0
        while True:
            layer = step % layers
            n = int(self.rng.integers(1, 7))
            k, v = rows(self.rng, n, hkv, d), rows(self.rng, n, hkv, d)
            body = {"k": wire.encode_array(k), "v": wire.encode_array(v), "offset": self.model.lengths[layer]}
            try:
                r = client.post(f"/v1/sessions/{self.sid}/layers/{layer}/kv", content=wire.packb(body))
            except httpx.TransportError:
                break  # killed
            if r.status_code != 200:
                self.bad.append(r.text)
                break
            self.model.add(layer, k, v)
            self.acks[layer].append((time.time(), self.model.lengths[layer]))
            step += 1
        client.close()

    def acked_before(self, layer: int, t: float) -> int:
        return max([n for at, n in self.acks[layer] if at < t], default=0)


@pytest.mark.usefixtures("engine")  # needs an adapter: skips without one, fails under CI
def test_sigkill_mid_load_loses_nothing_older_than_the_last_sync(tmp_path, rng):
    snapdir, log = tmp_path / "snapshots", tmp_path / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _env(ATTNSERVE_SNAPSHOT_DIR=str(snapdir), ATTNSERVE_SYNC_INTERVAL_S="0.2", ATTNSERVE_PAGE_TOKENS=str(P))
    proc = _start(port, env, log)
    loads = []
    try:
        api = Api(url)
        for sid, shape in SHAPES.items():
            api.create(session_id=sid, max_tokens=100_000, seed=int(rng.integers(1 << 40)), **shape)
            loads.append(Appender(url, sid, shape, int(rng.integers(1 << 31))))
        for t in loads:
            t.start()
        deadline = time.monotonic() + 60
        while min(min(len(a) for a in t.acks.values()) for t in loads) < 40:  # several pages a layer
            assert time.monotonic() < deadline and all(t.is_alive() for t in loads), [t.bad for t in loads]
            time.sleep(0.05)
        mark = time.time()
        while True:  # a sync that started after the mark, and finished
            info = api.call("GET", "/v1/info").body["journal"]
            if info["last_sync_finished"] and info["last_sync_started"] > mark:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        synced = info["last_sync_started"]
        time.sleep(0.15)  # more rows after it: those may be lost
        proc.kill()  # SIGKILL: no shutdown, no snapshot
        proc.wait()
        for t in loads:
            t.join(timeout=30)
            assert not t.is_alive() and not t.bad, t.bad
        api.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(snapdir.glob("*.snap"))  # a hard kill wrote no snapshot: all comes from journals
    assert sorted(p.name for p in snapdir.glob("*.journal")) == [
        "f32-s.journal",
        "half-s.journal",
        "mixed-s.journal",
        "tq-s.journal",
    ]

    proc = _start(port, env, log)
    try:
        api = Api(url)
        for t in loads:
            sid, shape = t.sid, t.shape
            info = api.info(sid)
            h, hkv, d = shape["num_qo_heads"], shape["num_kv_heads"], shape["head_dim"]
            twin = api.create(**{**shape, "seed": info["seed"], "max_tokens": 100_000})["session_id"]
            for layer, restored in enumerate(info["lengths"]):
                must = t.acked_before(layer, synced) // P * P
                assert must <= restored <= t.model.lengths[layer], (sid, layer, must, restored)
                assert restored % P == 0  # whole pages: no torn row
                assert must >= P, "the test kept too little load to be meaningful"
                k, v = t.model.k[layer][:restored], t.model.v[layer][:restored]
                assert api.append(twin, layer, k, v).status == 200
                q = rows(rng, 2, h, d)
                got = api.attend(sid, layer, q).body["out"]
                assert got.tobytes() == api.attend(twin, layer, q).body["out"].tobytes()  # the rows sent, bit for bit
                if info["layer_formats"][layer] == "f32":
                    want = Model(h, hkv, d, 1)
                    want.add(0, k, v)
                    assert rel_err(got, want.attention(0, q)) <= F32_TOL
                # and it goes on from there
                more = rows(rng, 3, hkv, d)
                r = api.append(sid, layer, more, more, offset=restored)
                assert r.status == 200 and from_wire(r.body)["length"] == restored + 3
            api.delete(twin)
        api.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_new_session_starts_its_journal_afresh(engine, tmp_path, rng):
    """A journal file left under a name (a session kept at start because it did not
    fit, say) is replaced, not appended to, by a new session of that name."""
    from attnserve.config import Settings
    from svc_helpers import LiveServer

    from _core import CORE_PAGE_TOKENS

    snapdir = tmp_path / "snaps"
    settings = Settings(snapshot_dir=str(snapdir), sync_interval_s=0.05)
    srv = LiveServer(settings, engine=engine).start()
    try:
        (snapdir / "again.journal").write_bytes(b"not this session's journal")  # left after the start
        api = Api(srv.url)
        api.create(session_id="again", num_qo_heads=2, num_kv_heads=1, head_dim=8)
        k = rows(rng, 3 * CORE_PAGE_TOKENS + 1, 1, 8)  # three whole pages, and one row
        assert api.append("again", 0, k, k).status == 200
        deadline = time.monotonic() + 30
        while True:
            try:
                j = J.parse_journal((snapdir / "again.journal").read_bytes(), lambda *a: 10**6)
            except Exception:
                j = None
            if j is not None and len(j.pages[0]) == 3:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert j.session_id == "again" and j.config.head_dim == 8
        api.close()
    finally:
        srv.stop()


def test_a_torn_journal_keeps_its_whole_frames():
    layout = PageLayout("f32", 1, 8)
    config = SessionConfig(1, 2, 1, 8, "f32", 1000, 7)
    kb, vb = layout.buffer_bytes(P)
    pages = [(bytes([i]) * kb, bytes([100 + i]) * vb) for i in range(3)]
    data = J.header_frame("s", None, config, P) + b"".join(J.page_frame(0, i, *pg) for i, pg in enumerate(pages))
    for cut in (1, 9, 20):  # a crash in the middle of the last frame
        j = J.parse_journal(data[:-cut], lambda *a: 10**6)
        assert [len(x) for x in j.pages] == [2] and j.pages[0] == pages[:2]
        assert j.valid_bytes == len(data) - len(J.page_frame(0, 2, *pages[2]))
    flipped = bytearray(data)
    flipped[-5] ^= 1  # a flipped bit fails the CRC: that frame and after are dropped
    assert [len(x) for x in J.parse_journal(bytes(flipped), lambda *a: 10**6).pages] == [2]
    n, cap, k, v = J.assemble(layout, P, pages[:2])
    assert (n, cap) == (2 * P, 2 * P) and k == pages[0][0] + pages[1][0]


def _journal_of_pages(n: int) -> tuple[bytes, list[tuple[bytes, bytes]], list[bytes]]:
    layout = PageLayout("f32", 1, 8)
    config = SessionConfig(1, 2, 1, 8, "f32", 1000, 7)
    kb, vb = layout.buffer_bytes(P)
    pages = [(bytes([i]) * kb, bytes([100 + i]) * vb) for i in range(n)]
    frames = [J.header_frame("s", None, config, P)] + [J.page_frame(0, i, *pg) for i, pg in enumerate(pages)]
    return b"".join(frames), pages, frames


def test_a_bad_frame_in_the_middle_is_corruption_not_a_torn_tail():
    data, pages, frames = _journal_of_pages(4)
    at = sum(map(len, frames[:2]))  # page 1's frame: a flipped bit, two good frames after it
    flipped = bytearray(data)
    flipped[at + 20] ^= 1
    j = J.parse_journal(bytes(flipped), lambda *a: 10**6)
    assert j.pages[0] == pages[:1] and j.valid_bytes == at
    assert j.corrupt and j.bytes_after_bad == len(frames[3]) + len(frames[4]) and j.frames_after_bad == 2
    flipped[at] ^= 1  # and its length by one: no good frame where it says the next one starts
    j = J.parse_journal(bytes(flipped), lambda *a: 10**6)
    assert j.pages[0] == pages[:1] and j.corrupt and j.frames_after_bad == 0
    for torn in (data[:-9], data[:-1] + bytes([data[-1] ^ 1]), data + b"\x00" * 5):  # the last write torn
        j = J.parse_journal(torn, lambda *a: 10**6)
        assert not j.corrupt and j.bytes_after_bad == 0 and j.pages[0] == pages[: 4 if len(torn) > len(data) else 3]


def test_a_corrupt_journal_is_kept_aside_and_its_good_prefix_restored(tmp_path, caplog):
    """Corruption keeps a copy of the whole file as ``.bad`` and says so at ERROR; a
    torn tail is cut with a warning and no copy, as before."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from attnserve.persistence import SnapshotDir

    caplog.set_level(logging.WARNING, logger="attnserve.persistence")
    data, pages, frames = _journal_of_pages(4)
    at = sum(map(len, frames[:3]))
    corrupt = bytearray(data)
    corrupt[at + 30] ^= 1  # page 2 of 4
    path = tmp_path / "s.journal"
    path.write_bytes(bytes(corrupt))
    snapdir = SnapshotDir(tmp_path, runtime=None)
    engine = SimpleNamespace(max_tokens_limit=lambda *a: 10**6)
    journal = asyncio.run(snapdir._read_journal(path, engine))
    assert journal.pages[0] == pages[:2] and path.read_bytes() == data[:at]
    assert (tmp_path / "s.journal.bad").read_bytes() == bytes(corrupt)  # nothing lost without a copy
    [rec] = [r for r in caplog.records if "journal" in r.getMessage()]
    assert rec.levelno == logging.ERROR and "corrupt" in rec.getMessage() and "torn" not in rec.getMessage()
    assert rec.good_frames_after_bad_frame == 1 and rec.copied_to == "s.journal.bad"
    caplog.clear()
    path.write_bytes(data[:-7])  # a torn tail: cut, no copy
    journal = asyncio.run(snapdir._read_journal(path, engine))
    assert journal.pages[0] == pages[:3] and path.read_bytes() == data[: -len(frames[-1])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.journal", "s.journal.bad"]
    [rec] = [r for r in caplog.records if "journal" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "torn" in rec.getMessage()


def test_a_snapshot_and_its_journal_give_each_layer_the_longer(tmp_path):
    """At a start with both files, each layer comes from whichever holds more rows;
    a journal of another page size is deleted and starts again."""
    from attnserve.persistence import SnapshotDir

    layout = PageLayout("f32", 1, 8)
    config = SessionConfig(2, 2, 1, 8, "f32", 1000, 7)
    kb, vb = layout.buffer_bytes(P)
    pages = [(bytes([i + 1]) * kb, bytes([50 + i]) * vb) for i in range(3)]
    path = tmp_path / "s.journal"
    path.write_bytes(
        J.header_frame("s", None, config, P)
        + b"".join(J.page_frame(0, i, *pg) for i, pg in enumerate(pages))  # layer 0: 3 pages
        + J.page_frame(1, 0, *pages[0])  # layer 1: 1 page
    )
    journal = J.parse_journal(path.read_bytes(), lambda *a: 10**6)
    snap_k1, snap_v1 = (bytes([9]) * n for n in layout.buffer_bytes(40))
    snap_k0, snap_v0 = (bytes(n) for n in layout.buffer_bytes(2 * P))
    snapshot = [(2 * P - 1, 2 * P, snap_k0, snap_v0), (40, 40, snap_k1, snap_v1)]
    layers, journaled = SnapshotDir._with_journal(snapshot, journal, path, P)
    assert layers[0] == J.assemble(layout, P, pages)  # the journal's 3 pages beat 31 rows
    assert layers[1] == snapshot[1]  # 40 rows beat the journal's one page
    assert journaled == [3, 1] and path.exists()
    layers, journaled = SnapshotDir._with_journal([], journal, path, 2 * P)  # another page size now
    assert [n for n, *_ in layers] == [3 * P, P] and journaled == [0, 0] and not path.exists()
