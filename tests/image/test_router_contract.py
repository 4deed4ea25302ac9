"""Session pinning through the router, checked from outside, as tests/deploy does
with processes: here deploy/test-image.sh runs two service containers of the
image and an nginx container with deploy/nginx/attnserve.conf in front of them.

- every request naming a session reaches the replica that holds it (the router's
  access log names the upstream of each request; the replica names itself in
  X-Attnserve-Instance), outputs correct against float64, and sessions spread;
- requests without an id (POST create, list) go to both replicas;
- the last test stops one replica (ATTNSERVE_TEST_STOP_REPLICA): its sessions
  answer 404 session-not-found through the router, the other's keep working, and
  a lost session is recovered by PUT under the same id and a replay of its K/V.

Needs ATTNSERVE_TEST_URL (the router), ATTNSERVE_TEST_REPLICAS,
ATTNSERVE_TEST_ROUTER_ACCESS_LOG and ATTNSERVE_TEST_STOP_REPLICA (conftest.py);
skipped without ATTNSERVE_TEST_REPLICAS. Tests run in file order.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from attnserve_client import Client, SessionNotFound
from image_helpers import F32_TOL, SESSION_PATH, TARGET, Model, new_id, rel_err, rows

RUNS_HERE = bool(TARGET.url and TARGET.replicas)
pytestmark = [
    pytest.mark.skipif(
        not RUNS_HERE,
        reason="runs through a router in front of replicas: set ATTNSERVE_TEST_URL (the router) and "
        "ATTNSERVE_TEST_REPLICAS, as deploy/test-image.sh does",
    ),
    pytest.mark.timeout(300),
]

H, KV, D, LAYERS = 4, 2, 32, 2
LOG_LINE = re.compile(
    r'"(?P<request>[^"]*)" (?P<status>\d+) \d+ rt=\S+ urt=\S+ upstream=(?P<upstream>.*?) '
    r"instance=(?P<instance>\S*) key=(?P<key>\S*)$"
)


def access_lines() -> list[dict[str, str]]:
    assert TARGET.access_log, "ATTNSERVE_TEST_ROUTER_ACCESS_LOG is not set"
    text = Path(TARGET.access_log).read_text()
    return [m.groupdict() for m in map(LOG_LINE.search, text.splitlines()) if m]


def owner(sid: str, alive: set[str] | None = None) -> str | None:
    """Ask every replica directly (not through the router) which one holds ``sid``."""
    holders = []
    for name, url in TARGET.replicas.items():
        if alive is not None and name not in alive:
            continue
        r = httpx.get(f"{url}/v1/sessions/{sid}", headers={"Accept": "application/json"}, trust_env=False)
        if r.status_code == 200:
            holders.append(name)
        else:
            assert r.status_code == 404 and r.json()["type"] == "/problems/session-not-found", r.text
    assert len(holders) <= 1, f"{sid} is held by {holders}"
    return holders[0] if holders else None


class Sequence:
    """A session driven through the router, with every K/V row it sent."""

    def __init__(self, session, rng: np.random.Generator) -> None:
        self.session, self.rng = session, rng
        self.model = Model(H, KV, D, LAYERS)

    @property
    def sid(self) -> str:
        return self.session.session_id

    def prefill(self, n: int) -> None:
        for layer in range(LAYERS):
            k, v = rows(self.rng, n, KV, D), rows(self.rng, n, KV, D)
            assert self.session.append(layer, k, v) == self.model.lengths[layer] + n
            self.model.add(layer, k, v)

    def decode(self) -> None:
        for layer in range(LAYERS):
            q, k, v = rows(self.rng, 1, H, D), rows(self.rng, 1, KV, D), rows(self.rng, 1, KV, D)
            out = self.session.attend(layer, q, k=k, v=v)
            self.model.add(layer, k, v)
            assert rel_err(out, self.model.attention(layer, q)) <= F32_TOL


@pytest.fixture(scope="module")
def client():
    http = httpx.Client(trust_env=False, timeout=60.0)
    with Client(TARGET.url, http_client=http, max_retries=0) as c:
        yield c
    http.close()


def new_sequences(client, rng, per_replica: int, prefix: str) -> dict[str, list[Sequence]]:
    """PUT sessions through the router until each replica holds ``per_replica``."""
    by_owner: dict[str, list[Sequence]] = {name: [] for name in TARGET.replicas}
    for _ in range(200):
        if all(len(s) >= per_replica for s in by_owner.values()):
            break
        sid = new_id(prefix)
        session = client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, session_id=sid)
        who = owner(sid)
        assert who is not None, f"{sid} was created through the router but no replica holds it"
        by_owner[who].append(Sequence(session, rng))
    assert all(len(s) >= per_replica for s in by_owner.values()), {k: len(v) for k, v in by_owner.items()}
    return by_owner


def test_sessions_are_pinned_and_spread(client, rng):
    assert len(TARGET.replicas) >= 2, TARGET.replicas
    by_owner = new_sequences(client, rng, per_replica=3, prefix="pin")
    for seqs in by_owner.values():
        for seq in seqs:
            seq.prefill(7)
    for _ in range(3):
        for seqs in by_owner.values():
            for seq in seqs:
                seq.decode()
    upstreams: dict[str, set[str]] = {}
    instances: dict[str, set[str]] = {}
    for line in access_lines():
        m = SESSION_PATH.match(line["request"].split()[1])
        if m:
            upstreams.setdefault(m.group(1), set()).add(line["upstream"])
            instances.setdefault(m.group(1), set()).add(line["instance"])
    for who, seqs in by_owner.items():
        for seq in seqs:
            assert list(client.get_session(seq.sid).lengths) == seq.model.lengths == [10] * LAYERS
            # the router's log: every request of the session went to its owner, and
            # the owner named itself in each answer
            assert upstreams[seq.sid] == {TARGET.address(who)}, (seq.sid, who, upstreams[seq.sid])
            assert instances[seq.sid] == {who}, (seq.sid, who, instances[seq.sid])
            seq.session.delete()
            assert owner(seq.sid) is None


def test_requests_without_an_id_go_to_any_replica(client):
    before = len(access_lines())
    made = [
        client.create_session(num_qo_heads=H, num_kv_heads=KV, head_dim=D, server_assigned_id=True) for _ in range(16)
    ]
    for _ in range(16):
        client.list_sessions()
    lines = access_lines()[before:]
    everyone = {TARGET.address(name) for name in TARGET.replicas}
    posts = {line["upstream"] for line in lines if line["request"].startswith("POST /v1/sessions ")}
    lists = {line["upstream"] for line in lines if line["request"].startswith("GET /v1/sessions ")}
    assert posts == everyone and lists == everyone, (posts, lists)
    for session in made:
        who = owner(session.session_id)
        assert who is not None
        httpx.delete(f"{TARGET.replicas[who]}/v1/sessions/{session.session_id}", trust_env=False).raise_for_status()


def test_a_stopped_replica_loses_only_its_own_sessions(client, rng):
    assert TARGET.stop_replica, "set ATTNSERVE_TEST_STOP_REPLICA to a command that stops a replica ({name})"
    by_owner = new_sequences(client, rng, per_replica=2, prefix="fail")
    for seqs in by_owner.values():
        for seq in seqs:
            seq.prefill(5)
            seq.decode()
    names = list(TARGET.replicas)
    survivor, victim = names[0], names[-1]
    command = [part.replace("{name}", victim) for part in shlex.split(TARGET.stop_replica)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{TARGET.replicas[victim]}/livez", trust_env=False, timeout=5)
    before = len(access_lines())
    alive = set(names) - {victim}
    for seq in by_owner[victim]:
        with pytest.raises(SessionNotFound) as info:
            client.get_session(seq.sid)
        assert info.value.status == 404 and info.value.type == "/problems/session-not-found"
        with pytest.raises(SessionNotFound):
            seq.decode()
        assert owner(seq.sid, alive) is None
    for _ in range(2):
        for seq in by_owner[survivor]:
            seq.decode()
    # recreate (PUT, same id: now routed to the survivor) and replay, then carry on
    for seq in by_owner[victim]:
        session = client.create_session(
            num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS, session_id=seq.sid
        )
        for layer in range(LAYERS):
            session.append(layer, seq.model.k[layer], seq.model.v[layer])
        seq.session = session
        seq.decode()
        assert owner(seq.sid, alive) == survivor
    for line in access_lines()[before:]:
        assert line["upstream"].split(", ")[-1] == TARGET.address(survivor), line
    for seqs in by_owner.values():
        for seq in seqs:
            seq.session.delete()
