#!/usr/bin/env python3
"""Static checks that the deployment files agree with each other and with the brief.

Run by deploy/ci-static-checks.sh (needs PyYAML). Checks, with no container engine:

Dockerfile
  - every stage starts FROM debian:bookworm-slim; a builder stage makes wheels with
    ``pip wheel``; the runtime stage installs them with ``--no-index`` into a venv;
  - the runtime has libvulkan1, mesa-vulkan-drivers and the NVIDIA ICD file, and
    NVIDIA_DRIVER_CAPABILITIES includes graphics and compute;
  - it runs as a non-root user, EXPOSEs ATTNSERVE_PORT, and its HEALTHCHECK runs
    deploy/healthcheck.py (which asks /readyz), with a start period long enough to
    restore compose's memory budget at the measured restore speed;
  - every file it COPYs from the context exists and passes .dockerignore.
docker-compose.yml and deploy/nginx/
  - one replica per GPU: distinct device ids, capabilities gpu and graphics,
    ATTNSERVE_INSTANCE_NAME = hostname = service name;
  - deploy/nginx/compose/upstreams.conf lists exactly those replicas, in order;
  - the router mounts deploy/nginx/attnserve.conf (the file the loopback test
    runs) and the compose include folder, and waits for every replica;
  - the routing file hashes the session id with ``hash ... consistent``;
  - every service's logs rotate (json-file with max-size and max-file).
deploy/k8s/ (deploy/check_k8s.py, which needs kubectl and kubernetes-validate:
deploy/k8s/validate-requirements.txt)
  - every overlay renders with kustomize and is valid against the Kubernetes
    schemas; its settings, port, probes, snapshot folder, drain and grace period,
    GPU, user and router agree with compose, the image and deploy/nginx.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore lets ``path`` (or the folder ``path/``) into the context:
    the last matching pattern wins; ``!`` re-includes; a pattern on a folder covers
    everything under it."""
    path = path.strip("/")
    included = True
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        pat = pat.strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatchcase(p, pat) for p in prefixes)
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatchcase(p, pat[3:]) for p in parts)
        if hit:
            included = negate
    return included


def check_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    ins = dockerfile_instructions(text)
    froms = [rest for word, rest in ins if word == "FROM"]
    check(len(froms) >= 2, f"Dockerfile: expected a builder and a runtime stage, got {froms}")
    for rest in froms:
        check(
            rest.split()[0] == "debian:bookworm-slim",
            f"Dockerfile: every stage must start FROM debian:bookworm-slim: {rest}",
        )
    stages: list[list[tuple[str, str]]] = []
    for word, rest in ins:
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
    builder, runtime = stages[0], stages[-1]
    b_run = " ".join(rest for w, rest in builder if w == "RUN")
    r_run = " ".join(rest for w, rest in runtime if w == "RUN")
    check("python3 -m pip wheel" in b_run, "Dockerfile: the builder stage builds wheels with python3 -m pip wheel")
    check(
        "python3 -m venv" in r_run and "--no-index" in r_run,
        "Dockerfile: the runtime installs the wheels offline into a venv",
    )
    check(
        not any(w == "COPY" and ("service" in rest or "client" in rest) for w, rest in runtime),
        "Dockerfile: the runtime stage must not copy the checkout (it installs the wheel)",
    )
    for pkg in ("python3", "libvulkan1", "mesa-vulkan-drivers"):
        check(re.search(rf"\b{re.escape(pkg)}\b", r_run) is not None, f"Dockerfile: the runtime installs {pkg}")
    for pkg in ("python3-pip", "build-essential", "gcc"):
        check(re.search(rf"\b{re.escape(pkg)}\b", r_run) is None, f"Dockerfile: the runtime should not install {pkg}")
    env = " ".join(rest for w, rest in runtime if w == "ENV")
    caps = re.search(r"NVIDIA_DRIVER_CAPABILITIES=(\S+)", env)
    check(
        bool(caps) and {"graphics", "compute"} <= set(caps.group(1).split(",")) if caps else False,
        "Dockerfile: NVIDIA_DRIVER_CAPABILITIES must include graphics and compute",
    )
    port = re.search(r"ATTNSERVE_PORT=(\d+)", env)
    exposed = [rest for w, rest in runtime if w == "EXPOSE"]
    check(
        bool(port) and exposed == [port.group(1)] if port else False, f"Dockerfile: EXPOSE {exposed} vs ATTNSERVE_PORT"
    )
    users = [rest for w, rest in runtime if w == "USER"]
    check(
        bool(users) and users[-1].split(":")[0] not in ("0", "root"),
        f"Dockerfile: must run as a non-root user, USER {users}",
    )
    health = [rest for w, rest in runtime if w == "HEALTHCHECK"]
    check(len(health) == 1 and "attnserve-healthcheck" in health[0], f"Dockerfile: HEALTHCHECK {health}")
    if health:
        check_start_period(health[0])
    check("/readyz" in (ROOT / "deploy" / "healthcheck.py").read_text(), "deploy/healthcheck.py must ask /readyz")
    copies = [rest for w, rest in runtime if w == "COPY"]
    check(
        any("deploy/vulkan/nvidia_icd.json /etc/vulkan/icd.d/" in c for c in copies),
        "Dockerfile: the NVIDIA ICD file goes to /etc/vulkan/icd.d/",
    )
    check(
        any("deploy/healthcheck.py /usr/local/bin/attnserve-healthcheck" in c for c in copies),
        "Dockerfile: the health check script is installed",
    )
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    for w, rest in ins:
        if w != "COPY" or "--from=" in rest:
            continue
        *sources, _dest = rest.split()
        for src in sources:
            check((ROOT / src).exists(), f"Dockerfile: COPY {src}: no such file in the repository")
            check(dockerignore_allows(src, patterns), f"Dockerfile: COPY {src}: excluded by .dockerignore")
    icd = json.loads((ROOT / "deploy" / "vulkan" / "nvidia_icd.json").read_text())
    check(
        icd.get("ICD", {}).get("library_path") == "libGLX_nvidia.so.0" and "file_format_version" in icd,
        f"nvidia_icd.json: {icd}",
    )


# The restore speed measured with bench/snapshot_speed.py (1 GiB of f32 sessions,
# 2 shared cores, lavapipe; docs/deploy.md, "Health check start period"), and
# the time to ready with nothing to restore (device open, pipelines, the default
# kernel warm-up with Mesa's shader cache empty, as in a new container): 13.5 s
# measured when the warm-up was f32's alone, plus the most its tq4v3 sessions added
# in side-by-side runs (issue 52: 5-10 s on 2 busy cores).
RESTORE_BYTES_PER_S = 105_101_133
READY_EMPTY_S = 13.5 + 10


def compose_budget() -> int:
    """The memory budget docker-compose.yml gives a replica by default."""
    text = (ROOT / "docker-compose.yml").read_text()
    m = re.search(r"ATTNSERVE_MEMORY_BUDGET_BYTES:\s*\$\{ATTNSERVE_MEMORY_BUDGET_BYTES:-(\d+)\}", text)
    check(m is not None, "compose: ATTNSERVE_MEMORY_BUDGET_BYTES: ${ATTNSERVE_MEMORY_BUDGET_BYTES:-<bytes>}")
    return int(m.group(1)) if m else 0


def check_start_period(health: str) -> None:
    """The HEALTHCHECK's start period covers a restore of compose's whole budget."""
    m = re.search(r"--start-period=(\d+)s\b", health)
    check(m is not None, f"Dockerfile: HEALTHCHECK needs --start-period=<seconds>s: {health}")
    need = compose_budget() / RESTORE_BYTES_PER_S + READY_EMPTY_S
    have = int(m.group(1)) if m else 0
    check(
        have >= need,
        f"Dockerfile: HEALTHCHECK --start-period={have}s is shorter than a restore of the "
        f"compose budget ({compose_budget()} bytes at {RESTORE_BYTES_PER_S} B/s + {READY_EMPTY_S} s = {need:.0f} s)",
    )


def check_compose() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    replicas = {name: svc for name, svc in services.items() if svc.get("deploy", {}).get("resources")}
    check(len(replicas) >= 1, "compose: no replica with a device reservation")
    device_ids: list[str] = []
    for name, svc in replicas.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        check(len(devices) == 1, f"compose: {name} reserves one device entry")
        dev = devices[0]
        check(dev.get("driver") == "nvidia", f"compose: {name} device driver nvidia")
        check(len(dev.get("device_ids", [])) == 1, f"compose: {name} reserves exactly one GPU")
        check(
            {"gpu", "graphics"} <= set(dev.get("capabilities", [])),
            f"compose: {name} needs capabilities gpu and graphics",
        )
        device_ids += dev.get("device_ids", [])
        env = svc.get("environment", {})
        check(
            env.get("ATTNSERVE_INSTANCE_NAME") == name == svc.get("hostname"),
            f"compose: {name}: ATTNSERVE_INSTANCE_NAME and hostname must be the service name",
        )
    check(len(device_ids) == len(set(device_ids)), f"compose: replicas share a GPU: {device_ids}")
    upstreams = re.findall(r"^\s*server\s+(\S+)", (ROOT / "deploy/nginx/compose/upstreams.conf").read_text(), re.M)
    check(
        upstreams == [f"{name}:8421" for name in replicas],
        f"upstreams.conf {upstreams} must list the compose replicas {list(replicas)} on port 8421, in order",
    )
    router = services.get("router", {})
    volumes = router.get("volumes", [])
    check(
        "./deploy/nginx/attnserve.conf:/etc/nginx/conf.d/default.conf:ro" in volumes,
        "compose: the router mounts deploy/nginx/attnserve.conf as conf.d/default.conf",
    )
    check(
        "./deploy/nginx/compose:/etc/nginx/attnserve:ro" in volumes, "compose: the router mounts deploy/nginx/compose"
    )
    check(set(router.get("depends_on", {})) == set(replicas), "compose: the router waits for every replica")
    for name, svc in services.items():
        logging = svc.get("logging", {})
        options = logging.get("options", {})
        check(
            logging.get("driver") == "json-file" and {"max-size", "max-file"} <= set(options),
            f"compose: {name}: logs rotate (logging driver json-file with max-size and max-file)",
        )
    routing = (ROOT / "deploy/nginx/attnserve.conf").read_text()
    check(
        re.search(r"^\s*hash \$attnserve_route_key consistent;", routing, re.M) is not None,
        "attnserve.conf: hash $attnserve_route_key consistent",
    )
    check("/v1/sessions/([A-Za-z0-9_-]{1,64})" in routing, "attnserve.conf: the key is the session id from the path")
    check(
        "include attnserve/upstreams.conf;" in routing and "include attnserve/server.conf;" in routing,
        "attnserve.conf: includes attnserve/upstreams.conf and attnserve/server.conf",
    )


def main() -> int:
    check_dockerfile()
    check_compose()
    # the Kubernetes manifests, against the same files (deploy/check_k8s.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import check_k8s

    k8s_summary: list[str] = []
    try:
        k8s = check_k8s.run_checks(ROOT)
        failures.extend(k8s.failures)
        k8s_summary = k8s.summary
    except check_k8s.ToolMissing as e:
        failures.append(f"deploy/k8s: {e}")
    if failures:
        for f in failures:
            print(f"FAIL {f}", file=sys.stderr)
        return 1
    print("ok -- Dockerfile, .dockerignore, compose, upstreams and routing file agree")
    for line in k8s_summary:
        print(f"ok -- Kubernetes manifests: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
