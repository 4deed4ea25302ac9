"""The router of docker-compose.yml, run for real on loopback (see conftest.py).

Two attnserve servers (replica-a, replica-b) behind Debian's nginx with
deploy/nginx/attnserve.conf. Shown here:

- every request of a session reaches the replica that holds it (the router's own
  access log names the upstream of each request), and sessions spread over both;
- requests without a session id (POST create, list) go to either replica;
- with one replica stopped, its sessions answer 404 session-not-found through the
  router, the other replica's sessions keep working with correct results, and a
  client recovers a lost session by recreating it (PUT, same id) and replaying;
- with no replica left, the router answers 503 not-ready as problem+json;
- each replica names itself in X-Attnserve-Instance.

The tests run in file order on one topology; the last ones stop replicas.
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid

import httpx
import numpy as np
import pytest

from attnserve_client import AsyncClient, AttendItem, Client, SessionNotFound, wire

pytestmark = pytest.mark.timeout(300)

H, KV, D, LAYERS = 4, 2, 32, 2
SESSION_PATH = re.compile(r"^/v1/sessions/([A-Za-z0-9_-]{1,64})(/|$)")


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 causal attention of the last q rows over k, v: q [n, H, D], k/v [L, KV, D]."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    out = np.empty(q.shape, np.float64)
    for i in range(n):
        end = L - n + i + 1
        for h in range(q.shape[1]):
            s = k[:end, h // group].astype(np.float64) @ q[i, h].astype(np.float64) / math.sqrt(D)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[:end, h // group].astype(np.float64)
    return out


class Recorder:
    """httpx response hook: (method, path, status, X-Attnserve-Instance) of every answer."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, str | None]] = []

    def __call__(self, response: httpx.Response) -> None:
        req = response.request
        self.seen.append((req.method, req.url.path, response.status_code, response.headers.get("x-attnserve-instance")))


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def client(topology, recorder):
    http = httpx.Client(trust_env=False, timeout=60.0, event_hooks={"response": [recorder]})
    with Client(topology.router_url, http_client=http, max_retries=0) as c:
        yield c
    http.close()


def owner(topology, sid: str) -> str | None:
    """Ask every live replica directly (not through the router) who holds ``sid``."""
    holders = []
    for r in topology.replicas:
        if r.proc is None or r.proc.poll() is not None:
            continue
        resp = httpx.get(f"{r.url}/v1/sessions/{sid}", headers={"Accept": "application/json"}, trust_env=False)
        if resp.status_code == 200:
            holders.append(r.name)
        else:
            assert resp.status_code == 404 and resp.json()["type"] == "/problems/session-not-found", resp.text
    assert len(holders) <= 1, f"{sid} is held by {holders}"
    return holders[0] if holders else None


class Sequence:
    """A session driven through the router, with every K/V row it sent, to check outputs."""

    def __init__(self, session, rng: np.random.Generator) -> None:
        self.session = session
        self.rng = rng
        self.k = [np.zeros((0, KV, D), np.float32) for _ in range(LAYERS)]
        self.v = [np.zeros((0, KV, D), np.float32) for _ in range(LAYERS)]

    @property
    def sid(self) -> str:
        return self.session.session_id

    def rows(self, n: int, heads: int) -> np.ndarray:
        return self.rng.standard_normal((n, heads, D), dtype=np.float32)

    def prefill(self, n: int) -> None:
        for layer in range(LAYERS):
            k, v = self.rows(n, KV), self.rows(n, KV)
            assert self.session.append(layer, k, v) == len(self.k[layer]) + n
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])

    def decode(self) -> None:
        """One fused decode step on every layer, each output checked against float64."""
        for layer in range(LAYERS):
            q, k, v = self.rows(1, H), self.rows(1, KV), self.rows(1, KV)
            out = self.session.attend(layer, q, k=k, v=v)
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
            np.testing.assert_allclose(out, reference(q, self.k[layer], self.v[layer]), atol=1e-4, rtol=1e-4)

    def lengths(self) -> list[int]:
        return [len(k) for k in self.k]

    def replay_onto(self, session) -> "Sequence":
        """Recreate-and-replay: push every row this sequence had into ``session``."""
        fresh = Sequence(session, self.rng)
        for layer in range(LAYERS):
            session.append(layer, self.k[layer], self.v[layer])
            fresh.k[layer], fresh.v[layer] = self.k[layer].copy(), self.v[layer].copy()
        return fresh


def new_sequences(client, topology, rng, *, per_replica: int, prefix: str) -> dict[str, list[Sequence]]:
    """PUT sessions through the router until each replica holds ``per_replica`` of them."""
    by_owner: dict[str, list[Sequence]] = {r.name: [] for r in topology.replicas}
    for i in range(200):
        if all(len(s) >= per_replica for s in by_owner.values()):
            break
        sid = f"{prefix}-{i}-{uuid.uuid4().hex[:8]}"
        session = client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, session_id=sid)
        who = owner(topology, sid)
        assert who is not None, f"{sid} was created through the router but no replica holds it"
        by_owner[who].append(Sequence(session, rng))
    assert all(len(s) >= per_replica for s in by_owner.values()), {k: len(v) for k, v in by_owner.items()}
    return by_owner


def test_routing_file_is_the_compose_one(topology):
    # The test runs deploy/nginx/attnserve.conf itself; only the addresses differ
    # from the compose upstreams (parameters such as max_fails are kept).
    assert "max_fails=1" in topology.upstreams_conf
    assert [r.address in topology.upstreams_conf for r in topology.replicas] == [True, True]


def test_sessions_are_pinned_and_spread(topology, client):
    rng = np.random.default_rng(5)
    by_owner = new_sequences(client, topology, rng, per_replica=3, prefix="pin")
    sequences = [s for seqs in by_owner.values() for s in seqs]
    assert len(sequences) >= 6
    for seq in sequences:
        seq.prefill(7)
    for _ in range(3):
        for seq in sequences:
            seq.decode()
    for who, seqs in by_owner.items():
        replica = topology.replica(who)
        for seq in seqs:
            # The info through the router and straight from the owner agree: every
            # append went there (a stray one would have failed with 404 elsewhere).
            via_router = client.get_session(seq.sid)
            assert list(via_router.lengths) == seq.lengths() == [10] * LAYERS
            direct = httpx.get(
                f"{replica.url}/v1/sessions/{seq.sid}", headers={"Accept": "application/json"}, trust_env=False
            )
            assert direct.status_code == 200 and direct.json()["lengths"] == seq.lengths()
    # The router's own log: every request naming a session went to one upstream,
    # the owner's.
    upstreams: dict[str, set[str]] = {}
    for line in topology.access_lines():
        method, path = line["request"].split()[:2]
        m = SESSION_PATH.match(path)
        if m:
            upstreams.setdefault(m.group(1), set()).add(line["upstream"])
    for who, seqs in by_owner.items():
        for seq in seqs:
            assert upstreams[seq.sid] == {topology.replica(who).address}, (seq.sid, who, upstreams[seq.sid])
    topology.extra["pinned"] = by_owner
    for seq in sequences:
        seq.session.delete()
        assert owner(topology, seq.sid) is None


def test_requests_without_an_id_go_to_any_replica(topology, client):
    before = len(topology.access_lines())
    made = [
        client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, server_assigned_id=True) for _ in range(24)
    ]
    owners = {info.session_id: owner(topology, info.session_id) for info in (s._config for s in made)}
    assert set(owners.values()) == {r.name for r in topology.replicas}, owners
    for _ in range(16):
        client.list_sessions()
    lines = topology.access_lines()[before:]
    list_upstreams = {line["upstream"] for line in lines if line["request"].startswith("GET /v1/sessions ")}
    assert list_upstreams == {r.address for r in topology.replicas}
    # Why clients of the router create with PUT: a POST session lives where the POST
    # landed, and requests naming it are hashed by its id, often elsewhere.
    reachable = []
    for sid in owners:
        try:
            client.get_session(sid)
            reachable.append(True)
        except SessionNotFound:
            reachable.append(False)
    assert not all(reachable), "every POST-created session happened to hash to its own replica"
    for sid, who in owners.items():
        httpx.delete(f"{topology.replica(who).url}/v1/sessions/{sid}", trust_env=False).raise_for_status()


def test_the_clients_default_create_is_routable(topology, client):
    # create_session() without an id PUTs under a fresh one: the router hashes it, so
    # every later request reaches the replica that holds the session
    made = [client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D) for _ in range(12)]
    assert {owner(topology, s.session_id) for s in made} == {r.name for r in topology.replicas}
    for s in made:
        assert client.get_session(s.session_id).session_id == s.session_id
        s.delete()


def test_a_batched_step_over_both_replicas_is_split_by_the_client(topology, client):
    """A batched step whose sessions live on both replicas: the client sends one
    request per replica (X-Attnserve-Route), each reaches the replica that holds its
    sessions, and every item is right against float64, in both body forms, sync and
    async; a stream holds a connection per replica and splits likewise; a stream
    opened with ``route=`` reaches the replica of that session."""
    rng = np.random.default_rng(11)
    by_owner = new_sequences(client, topology, rng, per_replica=2, prefix="batch")
    seqs = [s for group in by_owner.values() for s in group]
    for seq in seqs:
        seq.prefill(5)

    def step(layer: int, seqs: list[Sequence], n: int = 1):
        q = np.stack([seq.rows(n, H) for seq in seqs])
        k, v = np.stack([seq.rows(n, KV) for seq in seqs]), np.stack([seq.rows(n, KV) for seq in seqs])
        for i, seq in enumerate(seqs):
            seq.k[layer] = np.concatenate([seq.k[layer], k[i]])
            seq.v[layer] = np.concatenate([seq.v[layer], v[i]])
        return q, k, v

    def check(layer: int, seqs: list[Sequence], q, outs) -> None:
        for i, seq in enumerate(seqs):
            want = reference(q[i], seq.k[layer], seq.v[layer])
            np.testing.assert_allclose(outs[i], want, atol=1e-4, rtol=1e-4)

    before = len(topology.access_lines())
    q, k, v = step(0, seqs)
    check(0, seqs, q, client.attend_batch([AttendItem(s.session, 0, q[i], k[i], v[i]) for i, s in enumerate(seqs)]))
    q, k, v = step(1, seqs, n=2)
    check(1, seqs, q, client.attend_stacked([s.session for s in seqs], 1, q, k, v))
    lines = topology.access_lines()[before:]
    batches = sorted(line["upstream"] for line in lines if line["request"].startswith("POST /v1/batch/attend"))
    assert batches == sorted(2 * [r.address for r in topology.replicas]), batches  # per step, one per replica

    async def async_step() -> None:
        async with AsyncClient(topology.router_url, max_retries=0) as ac:
            ids = [s.sid for s in seqs]
            q, k, v = step(0, seqs)
            check(0, seqs, q, await ac.attend_stacked(ids, 0, q, k, v))  # ids it never saw: looked up first

    asyncio.run(async_step())
    # one stream for all: a connection per replica, each step split as over HTTP
    with client.stream() as stream:
        q, k, v = step(1, seqs)
        check(1, seqs, q, stream.attend_stacked([s.session for s in seqs], 1, q[:, 0], k[:, 0], v[:, 0])[:, None])
        q, k, v = step(0, seqs)
        futures = [stream.submit_attend(s.session, 0, q[i], k=k[i], v=v[i]) for i, s in enumerate(seqs)]
        check(0, seqs, q, [f.result(60) for f in futures])
        stream.ping()

    async def async_stream() -> None:
        async with AsyncClient(topology.router_url, max_retries=0) as ac:
            async with await ac.stream() as st:
                q, k, v = step(0, seqs)
                check(
                    0,
                    seqs,
                    q,
                    await st.attend_batch([AttendItem(s.sid, 0, q[i], k[i], v[i]) for i, s in enumerate(seqs)]),
                )

    asyncio.run(async_stream())
    for who, group in by_owner.items():  # a stream pinned to one replica
        with client.stream(route=group[0].session) as stream:
            q, k, v = step(1, group)
            check(1, group, q, stream.attend_stacked([s.session for s in group], 1, q[:, 0], k[:, 0], v[:, 0])[:, None])
    for seq in seqs:
        assert list(client.get_session(seq.sid).lengths) == seq.lengths() == [9, 9]
        seq.session.delete()


def test_replicas_name_themselves_in_a_header(topology, recorder, client):
    # traffic of its own (the module's other tests add more when they ran first)
    for i in range(6):
        s = client.create_session(num_qo_heads=2, num_kv_heads=1, head_dim=8, session_id=f"hdr-{i}")
        s.info()
        s.delete()
    answers = [(m, p, s, inst) for m, p, s, inst in recorder.seen if p.startswith("/v1/")]
    assert answers, "no request was recorded"
    names = {inst for *_, inst in answers}
    assert None not in names, [a for a in answers if a[3] is None][:5]
    assert names == {r.name for r in topology.replicas}
    # Per session, one name: the replica that holds it.
    by_session: dict[str, set[str]] = {}
    for _, path, status, inst in answers:
        m = SESSION_PATH.match(path)
        if m and status < 400:
            by_session.setdefault(m.group(1), set()).add(inst)
    pinned = topology.extra.get("pinned", {})
    for who, seqs in pinned.items():
        for seq in seqs:
            assert by_session[seq.sid] == {who}, (seq.sid, by_session[seq.sid])


def test_load_test_through_the_router(topology):
    """loadtest.py against the router: PUT sessions spread over both replicas, no
    error, correct decode outputs, and each replica's own metrics scraped."""
    from loadtest import loadtest

    cfg = loadtest.parse_args(
        [
            "--url",
            topology.router_url,
            "--sessions",
            "4",
            "--duration",
            "3",
            "--layers",
            "2",
            "--prefill",
            "24",
            "--chunk",
            "12",
            "--decode-steps",
            "6",
            "--qo-heads",
            str(H),
            "--kv-heads",
            str(KV),
            "--head-dim",
            str(D),
            "--verify",
            "0.5",
            "--seed",
            "3",
            "--progress",
            "off",
            *[arg for r in topology.replicas for arg in ("--metrics-url", r.url)],
        ]
    )
    before = len(topology.access_lines())
    report = asyncio.run(loadtest.run(cfg))
    assert report["error_count"] == 0, (report["errors"], report["error_examples"])
    assert report["verify"]["checked"] > 0 and report["verify"]["failed"] == 0
    assert report["operations"]["decode_step"]["count"] > 0
    assert loadtest.exit_code(report) == 0
    # Both replicas served sessions of the run, and each one's metrics moved.
    session_lines = [line for line in topology.access_lines()[before:] if " /v1/sessions/lt-" in line["request"]]
    assert {line["upstream"] for line in session_lines} == {r.address for r in topology.replicas}
    for r in topology.replicas:
        delta = report["server_metrics"][r.url]["delta"]
        assert any(key.startswith("attnserve_requests_total") and "attend" in key for key in delta), r.name


def test_a_stopped_replica_loses_only_its_own_sessions(topology, client):
    rng = np.random.default_rng(11)
    by_owner = new_sequences(client, topology, rng, per_replica=2, prefix="fail")
    for seqs in by_owner.values():
        for seq in seqs:
            seq.prefill(5)
            seq.decode()
    survivor, victim = topology.replica("replica-a"), topology.replica("replica-b")
    status = victim.stop()
    assert status in (0, -15, 143), f"replica-b exited with {status} on SIGTERM"
    before = len(topology.access_lines())

    # The lost replica's sessions: 404 session-not-found through the router, for
    # every kind of request, and nothing is created by those requests.
    for seq in by_owner[victim.name]:
        with pytest.raises(SessionNotFound) as info:
            client.get_session(seq.sid)
        assert info.value.status == 404 and info.value.type == "/problems/session-not-found"
        with pytest.raises(SessionNotFound):
            seq.decode()
        with pytest.raises(SessionNotFound):
            seq.session.append(0, seq.rows(1, KV), seq.rows(1, KV))
        assert owner(topology, seq.sid) is None

    # The survivor's sessions keep working, with correct results.
    for _ in range(3):
        for seq in by_owner[survivor.name]:
            seq.decode()
    for seq in by_owner[survivor.name]:
        assert list(client.get_session(seq.sid).lengths) == seq.lengths() == [9] * LAYERS
        assert owner(topology, seq.sid) == survivor.name

    # What a client does on session-not-found: recreate the session (PUT, same id;
    # it now lands on the survivor) and replay its K/V, then carry on.
    for seq in by_owner[victim.name]:
        session = client.create_session(
            num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, session_id=seq.sid
        )
        recovered = seq.replay_onto(session)
        assert list(client.get_session(seq.sid).lengths) == recovered.lengths()
        recovered.decode()
        assert owner(topology, seq.sid) == survivor.name

    # Everything after the stop was answered by the survivor (an attempt on the
    # stopped one, refused, shows first in the upstream list).
    for line in topology.access_lines()[before:]:
        assert line["upstream"].split(", ")[-1] == survivor.address, line
    for seqs in by_owner.values():
        for seq in seqs:
            httpx.delete(f"{survivor.url}/v1/sessions/{seq.sid}", trust_env=False)


def test_no_replica_left_is_a_503_problem(topology):
    for r in topology.replicas:
        r.stop()
    resp = httpx.post(
        f"{topology.router_url}/v1/sessions/gone/layers/0/attend",
        content=wire.packb({"q": wire.encode_array(np.zeros((1, H, D), np.float32))}),
        headers={"Content-Type": wire.MSGPACK},
        trust_env=False,
    )
    assert resp.status_code == 503
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["type"] == "/problems/not-ready" and resp.json()["status"] == 503
