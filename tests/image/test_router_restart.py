"""A replica restarted behind the router keeps its sessions: deploy/test-image.sh
runs docker-compose.yml with podman-compose, where each replica writes its
sessions to its snapshot volume on SIGTERM and restores them before it is ready.

Sessions are made through the router (PUT with an id) until each replica holds
two (the replica that answered names itself in X-Attnserve-Instance), prefilled
and decoded with float64 oracles. ATTNSERVE_TEST_RESTART_REPLICA (``{name}``: the
replica's name) restarts one replica and returns once the router can reach it
again; then every session, the restarted replica's included, answers through the
router from the replica that held it, with its lengths kept, and decodes on,
oracle-exact.

Needs ATTNSERVE_TEST_URL (the router), ATTNSERVE_TEST_REPLICAS (the names; the
addresses are not used: a restarted container may get a new one) and
ATTNSERVE_TEST_RESTART_REPLICA; skipped without the last.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time

import httpx
import pytest

from attnserve_client import Client
from image_helpers import F32_TOL, TARGET, Model, new_id, rel_err, rows

RESTART = os.environ.get("ATTNSERVE_TEST_RESTART_REPLICA") or None
RUNS_HERE = bool(TARGET.url and TARGET.replicas and RESTART)
pytestmark = [
    pytest.mark.skipif(
        not RUNS_HERE,
        reason="restarts a replica behind the router: set ATTNSERVE_TEST_URL, ATTNSERVE_TEST_REPLICAS and "
        "ATTNSERVE_TEST_RESTART_REPLICA, as deploy/test-image.sh does for its compose run",
    ),
    pytest.mark.timeout(600),
]

H, KV, D, LAYERS = 4, 2, 32, 2
SHAPE = dict(num_qo_heads=H, num_kv_heads=KV, head_dim=D, num_layers=LAYERS)
INSTANCE = "x-attnserve-instance"


@pytest.fixture(scope="module")
def http():
    with httpx.Client(base_url=TARGET.url, trust_env=False, timeout=60.0) as h:
        yield h


def holder(http: httpx.Client, sid: str) -> tuple[int, str | None, dict]:
    r = http.get(f"/v1/sessions/{sid}", headers={"Accept": "application/json"})
    return r.status_code, r.headers.get(INSTANCE), r.json()


def test_a_restarted_replica_keeps_its_sessions(http, rng):
    by_owner: dict[str, list[tuple[str, Model]]] = {name: [] for name in TARGET.replicas}
    for _ in range(200):
        if all(len(v) >= 2 for v in by_owner.values()):
            break
        sid = new_id("restart")
        r = http.put(f"/v1/sessions/{sid}", json=SHAPE)
        assert r.status_code == 201, r.text
        by_owner[r.headers[INSTANCE]].append((sid, Model(H, KV, D, LAYERS)))
    assert all(len(v) >= 2 for v in by_owner.values()), {k: len(v) for k, v in by_owner.items()}

    client = Client(TARGET.url, http_client=httpx.Client(trust_env=False, timeout=60.0), max_retries=0)

    def decode(sid: str, model: Model) -> None:
        session = client.get_session(sid)
        for layer in range(LAYERS):
            q, k, v = rows(rng, 1, H, D), rows(rng, 1, KV, D), rows(rng, 1, KV, D)
            out = session.attend(layer, q, k=k, v=v)
            model.add(layer, k, v)
            assert rel_err(out, model.attention(layer, q)) <= F32_TOL

    for seqs in by_owner.values():
        for sid, model in seqs:
            session = client.get_session(sid)
            for layer in range(LAYERS):
                n = int(rng.integers(3, 40))
                k, v = rows(rng, n, KV, D), rows(rng, n, KV, D)
                session.append(layer, k, v)
                model.add(layer, k, v)
            decode(sid, model)

    victim = list(TARGET.replicas)[-1]
    t0 = time.monotonic()
    command = [part.replace("{name}", victim) for part in shlex.split(RESTART)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the replica restores before it is ready; until then the router answers from the other one (404)
    deadline = time.monotonic() + 180
    for sid, model in by_owner[victim]:
        while True:
            status, who, body = holder(http, sid)
            if status == 200:
                break
            assert status in (404, 502, 503) and time.monotonic() < deadline, (status, who, body)
            time.sleep(0.5)
        assert who == victim and body["lengths"] == model.lengths, (who, body)
    print(f"\n{victim} restarted and serving its sessions again after {time.monotonic() - t0:.1f} s")
    for seqs in by_owner.values():
        for sid, model in seqs:
            status, who, body = holder(http, sid)
            assert status == 200 and who in by_owner and (sid, model) in by_owner[who], (sid, who)
            assert body["lengths"] == model.lengths
            decode(sid, model)  # bit-exact state: the oracle still holds after the restart
    for seqs in by_owner.values():
        for sid, _ in seqs:
            client.delete_session(sid)
    client.close()
