#!/usr/bin/env bash
# The container image, built and run for real, with podman, on a machine with no
# Docker engine and no container registry (docs/deploy.md, "The image, built and
# run with podman"):
#
#   1. tools: podman, runc, debootstrap and the dnsname CNI plugin (compose's service
#      names) from Debian's packages (apt, once);
#   2. base: debian:bookworm-slim made locally: `debootstrap --variant=minbase
#      bookworm` from Debian's mirror, trimmed like the official slim image, kept
#      as a tarball in $ATTNSERVE_IMAGE_CACHE and imported into podman under
#      docker.io/library/debian:bookworm-slim (skipped when that image exists);
#   3. build: the repository's Dockerfile, unchanged, `podman build --format docker
#      --pull=never`, from podman's layer cache when the image then holds this
#      checkout's files (deploy/image/image_matches_checkout.py), else again with
#      --no-cache; and a router image on the same base with Debian's nginx
#      (deploy/image/router.Containerfile);
#   4. one container on a free 127.0.0.1 port with lavapipe as the device: /readyz,
#      the process runs as uid 10001, the image's HEALTHCHECK passes (and fails on
#      a dead URL), tests/image/test_api_contract.py against it, then a stop
#      (SIGTERM) that must end in a clean exit, not a kill;
#   5. the compose topology: two service containers and the router container
#      running deploy/nginx/attnserve.conf, and tests/image/ through the router
#      (the API checks, session pinning and spread, a stopped replica);
#   6. docker-compose.yml itself, run by podman-compose (installed with pip into
#      the venv deploy/_python.sh picks, when missing) with deploy/compose/lavapipe.yml
#      over it: the stack up, tests/image through its router, a replica stopped and
#      started, and one restarted, keeping their sessions (deploy/image/test-compose.sh).
#
# Containers of steps 4-5 use the host's network (--network host) and listen on
# 127.0.0.1 only; compose's (6) a bridge network, with the router on 127.0.0.1.
# Every container this run starts is removed at exit, failure or not. Idempotent;
# runs as root (apt, podman). Prints the time of each step.
#
#   bash deploy/test-image.sh
#
# Environment: ATTNSERVE_IMAGE_CACHE (default /var/cache/attnserve-image),
# ATTNSERVE_IMAGE_TAG (localhost/attnserve:test), DEBIAN_MIRROR
# (http://deb.debian.org/debian), ATTNSERVE_IMAGE_REBASE=1 to make the base anew.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

CACHE="${ATTNSERVE_IMAGE_CACHE:-/var/cache/attnserve-image}"
IMAGE="${ATTNSERVE_IMAGE_TAG:-localhost/attnserve:test}"
ROUTER_IMAGE="${IMAGE%%:*}-router:${IMAGE##*:}"
BUILDER_IMAGE="${IMAGE%%:*}-builder:${IMAGE##*:}"
BASE="docker.io/library/debian:bookworm-slim"
BASE_TAR="$CACHE/debian-bookworm-minbase-slim.tar"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
LABEL="org.attnserve.test-image"
RUN_ID="$$-$(date +%s)"
export CONTAINERS_CONF="$ROOT/deploy/image/containers.conf"
# What podman needs on this machine (deploy/image/containers.conf says why).
BUILD_LIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
RUN_LIMITS=(--ulimit host)

# podman asks systemd for a timer that runs the image's HEALTHCHECK every 10 s;
# there is no systemd here, and it logs that as an error at every run, stop and
# removal. The check itself is run below with `podman healthcheck run`.
# Every podman call closes fd 9 (the lock below), which the containers' conmon
# processes would otherwise keep open after this script ends.
podman() { command podman "$@" 9>&- 2> >(grep -v 'unable to get systemd connection' >&2); }

START_MS="$(date +%s%3N)"
STEP_MS="$START_MS"
TIMINGS=()
CONTAINERS=()
WORK=""

secs() { awk -v ms="$1" 'BEGIN { printf "%.1f", ms / 1000 }'; }
step() {
  local now; now="$(date +%s%3N)"
  if [ -n "${STEP_NAME:-}" ]; then
    TIMINGS+=("$(printf '%-54s %7s s' "$STEP_NAME" "$(secs $((now - STEP_MS)))")")
  fi
  STEP_NAME="$1"; STEP_MS="$now"
  printf '\n== %s  (+%s s)\n' "$1" "$(secs $((now - START_MS)))"
}
die() { echo "test-image: $*" >&2; exit 1; }

cleanup() {
  local rc=$?
  if [ "$rc" != 0 ] && [ "${#CONTAINERS[@]}" -gt 0 ]; then
    for c in "${CONTAINERS[@]}"; do
      echo "--- last lines of container $c" >&2
      podman logs --tail 40 "$c" 2>&1 | cut -c1-400 >&2 || true
    done
  fi
  if [ "${#CONTAINERS[@]}" -gt 0 ]; then
    podman rm -f -i -t 5 "${CONTAINERS[@]}" >/dev/null 2>&1 || true
  fi
  local left
  left="$(podman ps -aq --filter "label=$LABEL=$RUN_ID" 2>/dev/null || true)"
  [ -z "$left" ] || podman rm -f -i -t 5 $left >/dev/null 2>&1 || true
  if [ -n "${COMPOSE_UP:-}" ]; then
    compose down -v -t 5 >/dev/null 2>&1 || true
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
  if [ "$rc" != 0 ]; then
    echo "test-image: FAILED (exit $rc) after $(secs $(($(date +%s%3N) - START_MS))) s" >&2
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[ "$(id -u)" = 0 ] || die "run as root (apt-get, and podman with runc as root)"
WORK="$(mktemp -d /tmp/attnserve-image.XXXXXX)"
chmod 0755 "$WORK"

# ---------------------------------------------------------------------------
step "tools (podman, runc, debootstrap, dnsname)"
# `type -P` looks for the program on PATH only: `command -v podman` would find the
# wrapper function above and never install podman.
need=()
for pair in podman:podman runc:runc debootstrap:debootstrap; do
  type -P "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
# the CNI plugin that resolves compose's service names on its network (not on PATH)
[ -x /usr/lib/cni/dnsname ] || need+=(golang-github-containernetworking-plugin-dnsname)
if [ "${#need[@]}" -gt 0 ]; then
  echo "installing ${need[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
podman --version
runc --version | head -n 1

# One run at a time on this machine: containers, cache and tags are shared.
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock -w 1200 9 || die "another deploy/test-image.sh holds $CACHE/lock"
# Containers left by a run that was killed before its trap ran.
stale="$(podman ps -aq --filter "label=$LABEL" || true)"
if [ -n "$stale" ]; then
  echo "removing containers left by an earlier run: $(echo "$stale" | tr '\n' ' ')"
  podman rm -f -t 5 $stale >/dev/null
fi

# ---------------------------------------------------------------------------
step "python for the tests"
. deploy/_python.sh
if ! "$PY" -c 'import pytest, pytest_timeout, numpy, httpx, msgpack' 2>/dev/null; then
  echo "installing the project's test dependencies"
  pip_install -e ".[test]"
fi
"$PY" --version
if ! type -P "$SCRIPTS/podman-compose" >/dev/null 2>&1; then
  echo "installing podman-compose"
  pip_install "podman-compose>=1.1"
fi

# ---------------------------------------------------------------------------
step "base image ($BASE)"
if [ "${ATTNSERVE_IMAGE_REBASE:-0}" = 1 ]; then
  rm -f "$BASE_TAR"
  podman image rm -f "$BASE" >/dev/null 2>&1 || true
fi
if podman image exists "$BASE"; then
  echo "present: $(podman image inspect --format '{{.Id}} created {{.Created}}' "$BASE" | cut -c1-12,65-)"
else
  if [ ! -s "$BASE_TAR" ]; then
    echo "debootstrap --variant=minbase bookworm from $MIRROR (once; cached in $BASE_TAR)"
    ROOTFS="$CACHE/rootfs.tmp"
    rm -rf "$ROOTFS"
    debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
      || { tail -n 20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
    # As the official slim image: Debian's sources in deb822 form (with updates and
    # security), no docs, man pages or translations, apt caches cleaned.
    rm -f "$ROOTFS/etc/apt/sources.list"
    cat >"$ROOTFS/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# The "slim" variant: no documentation, man pages or translations.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
    cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    printf 'Acquire::Languages "none";\n' >"$ROOTFS/etc/apt/apt.conf.d/docker-no-languages"
    printf 'Apt::AutoRemove::SuggestsImportant "false";\n' >"$ROOTFS/etc/apt/apt.conf.d/docker-autoremove-suggests"
    find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$ROOTFS"/usr/share/{groff,info,linda,lintian,locale,man}/* \
      "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/lib/apt/lists/* \
      "$ROOTFS"/var/log/*.log "$ROOTFS"/var/log/apt/* "$ROOTFS"/tmp/* "$ROOTFS"/root/.bash_history
    tar --numeric-owner -C "$ROOTFS" -cf "$BASE_TAR.tmp" .
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$ROOTFS"
  fi
  echo "importing $BASE_TAR ($(du -m "$BASE_TAR" | cut -f1) MiB) as $BASE"
  podman import --change 'CMD ["bash"]' --change "LABEL $LABEL.base=debootstrap-minbase-bookworm" \
    "$BASE_TAR" "$BASE" >/dev/null
fi

# ---------------------------------------------------------------------------
step "build $IMAGE (the Dockerfile)"
BUILD_ARGS=(--format docker --pull=never --network host "${BUILD_LIMITS[@]}")
# Behind a TLS-intercepting proxy (SSL_CERT_FILE set), pip in the builder needs the
# host's CA bundle. It is mounted for the RUN steps only, as pip's site config
# folder (pip.conf + the bundle), so no package's own files are shadowed: mounting
# it over /etc/ssl/certs/ca-certificates.crt breaks the ca-certificates package's
# postinst ("Device or resource busy"). The image keeps an empty /etc/xdg/pip.
if [ -n "${SSL_CERT_FILE:-}" ] && [ -r "$SSL_CERT_FILE" ]; then
  mkdir -p "$WORK/build-ca"
  cp "$SSL_CERT_FILE" "$WORK/build-ca/ca.pem"
  printf '[global]\ncert = /etc/xdg/pip/ca.pem\n' >"$WORK/build-ca/pip.conf"
  chmod -R a+rX "$WORK/build-ca"
  BUILD_ARGS+=(-v "$WORK/build-ca:/etc/xdg/pip:ro")
  echo "pip in the build trusts \$SSL_CERT_FILE ($SSL_CERT_FILE)"
fi
# podman 4.3 (buildah 1.28) and `RUN --mount=type=bind,from=builder` with its
# layer cache: the mounted stage is not part of the cache key, so a cached build
# can keep the wheels of an earlier checkout; and when the builder stage comes
# whole from the cache, the mount finds no files ("couldn't find .../merged/wheels").
# So: a cached build, accepted only when it succeeds AND the image holds this
# checkout's files (deploy/image/image_matches_checkout.py); else a build without
# the cache. Either way the image is the Dockerfile's, from this checkout.
build_service() {
  podman build "${BUILD_ARGS[@]}" "$@" -f Dockerfile -t "$IMAGE" . >"$WORK/build.log" 2>&1 || return 1
  grep -E '^(\[[0-9]+/[0-9]+\] )?STEP|^--> Using cache' "$WORK/build.log" | sed 's/^/  /' | cut -c1-150
  echo "steps taken from the cache: $(grep -c -- '--> Using cache' "$WORK/build.log" || true)"
}
image_is_checkout() {
  podman run --rm --network host "${RUN_LIMITS[@]}" --entrypoint /opt/attnserve/bin/python "$IMAGE" \
    -c "$("$PY" deploy/image/image_matches_checkout.py --print-lister)" >"$WORK/image-files.txt" \
    && "$PY" deploy/image/image_matches_checkout.py <"$WORK/image-files.txt"
}
if build_service && image_is_checkout; then
  :
else
  grep -m1 "couldn't find" "$WORK/build.log" | cut -c1-200 || true
  echo "the cached build failed or kept files of an earlier checkout; building again without the cache"
  build_service --no-cache || { tail -n 40 "$WORK/build.log" >&2; die "podman build of the Dockerfile failed"; }
  image_is_checkout || die "the image does not hold this checkout's packages"
fi
# Tag the builder stage (all from the cache now), so that pruning keeps its layers.
podman build "${BUILD_ARGS[@]}" -f Dockerfile --target builder -t "$BUILDER_IMAGE" . >/dev/null 2>&1 \
  || die "podman build --target builder failed after the full build"

step "build $ROUTER_IMAGE (nginx)"
podman build "${BUILD_ARGS[@]}" -f deploy/image/router.Containerfile -t "$ROUTER_IMAGE" deploy/image \
  >"$WORK/build-router.log" 2>&1 \
  || { tail -n 40 "$WORK/build-router.log" >&2; die "podman build of the router image failed"; }
# Images of earlier builds that no tag uses any more (a changed checkout).
podman image prune -f >/dev/null 2>&1 || true

IMAGE_BYTES="$(podman image inspect --format '{{.Size}}' "$IMAGE")"
BASE_BYTES="$(podman image inspect --format '{{.Size}}' "$BASE")"
echo "image $IMAGE: $((IMAGE_BYTES / 1000000)) MB ($((IMAGE_BYTES / 1048576)) MiB; base $((BASE_BYTES / 1000000)) MB)"
podman image inspect --format 'user {{.Config.User}}, cmd {{.Config.Cmd}}, stop signal {{.Config.StopSignal}}, healthcheck {{.HealthCheck.Test}} every {{.HealthCheck.Interval}}' "$IMAGE"
[ "$(podman image inspect --format '{{.Config.User}}' "$IMAGE")" = "10001:10001" ] || die "the image's USER is not 10001:10001"
podman image inspect --format '{{.HealthCheck.Test}}' "$IMAGE" | grep -q attnserve-healthcheck \
  || die "the image has no HEALTHCHECK (built without --format docker?)"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_service NAME PORT [podman run args...]: a service container on 127.0.0.1:PORT.
start_service() {
  local name="$1" port="$2"; shift 2
  CONTAINERS+=("$name")
  podman run -d --name "$name" --label "$LABEL=$RUN_ID" --network host "${RUN_LIMITS[@]}" \
    -e ATTNSERVE_HOST=127.0.0.1 -e ATTNSERVE_PORT="$port" -e ATTNSERVE_ADAPTER=llvmpipe \
    -e ATTNSERVE_INSTANCE_NAME="$name" -e ATTNSERVE_LOG_LEVEL=warning \
    -e ATTNSERVE_MEMORY_BUDGET_BYTES=$((1 << 30)) "$@" "$IMAGE" >/dev/null
}

wait_ready() {
  local name="$1" url="$2"
  for i in $(seq 240); do
    if "$PY" deploy/healthcheck.py "$url/readyz" 2>/dev/null; then
      echo "$name ready on $url after $(awk -v i="$i" 'BEGIN { printf "%.1f", i / 2 }') s"
      return 0
    fi
    [ "$(podman container inspect --format '{{.State.Running}}' "$name")" = true ] \
      || die "container $name exited ($(podman container inspect --format '{{.State.ExitCode}}' "$name"))"
    sleep 0.5
  done
  die "container $name was not ready on $url within 120 s"
}

# stop_clean NAME: podman stop (SIGTERM, the image's STOPSIGNAL); the service
# must drain and exit by itself (0, or 143 when uvicorn re-raises SIGTERM), not be
# killed at the timeout (137).
stop_clean() {
  local name="$1" t0 rc
  t0="$(date +%s%3N)"
  podman stop -t 30 "$name" >/dev/null
  rc="$(podman container inspect --format '{{.State.ExitCode}}' "$name")"
  echo "$name stopped in $(secs $(($(date +%s%3N) - t0))) s, exit code $rc"
  [ "$rc" = 0 ] || [ "$rc" = 143 ] || die "$name exited with $rc on SIGTERM"
}

run_pytest() {
  "$PY" -m pytest -q -p no:cacheprovider "$@"
}

# ---------------------------------------------------------------------------
step "one container: start, user, healthcheck"
API="attnserve-image-api"
API_PORT="$(free_port)"
start_service "$API" "$API_PORT"
wait_ready "$API" "http://127.0.0.1:$API_PORT"
pid="$(podman container inspect --format '{{.State.Pid}}' "$API")"
uids="$(awk '/^Uid:/ { print $2, $3, $4, $5 }' "/proc/$pid/status")"
gids="$(awk '/^Gid:/ { print $2, $3, $4, $5 }' "/proc/$pid/status")"
echo "the service process (host pid $pid, $(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-60)): uids $uids, gids $gids"
[ "$uids" = "10001 10001 10001 10001" ] && [ "$gids" = "10001 10001 10001 10001" ] \
  || die "the service does not run as 10001:10001"
[ "$(podman exec "$API" id -u)" = 10001 ] || die "podman exec does not run as 10001"
# the snapshot folder compose mounts a volume on is the service user's to write
podman exec "$API" sh -c 'touch /var/lib/attnserve/snapshots/.w && rm /var/lib/attnserve/snapshots/.w' \
  || die "the service user cannot write /var/lib/attnserve/snapshots"
podman healthcheck run "$API" >/dev/null || die "the image's HEALTHCHECK failed on a ready container"
echo "HEALTHCHECK: healthy ($(podman container inspect --format '{{.State.Health.Status}}' "$API" 2>/dev/null || echo '?'))"
if podman exec "$API" /opt/attnserve/bin/python /usr/local/bin/attnserve-healthcheck http://127.0.0.1:1/readyz 2>/dev/null; then
  die "the health check command passed on a port where nothing listens"
fi
echo "HEALTHCHECK command fails on a dead URL: ok"
podman exec "$API" attnserve adapters 2>/dev/null | sed 's/^/  /' | head -n 5 || true

step "one container: tests/image/test_api_contract.py"
ATTNSERVE_TEST_URL="http://127.0.0.1:$API_PORT" ATTNSERVE_TEST_INSTANCE="$API" ATTNSERVE_TEST_ADAPTER=llvmpipe \
  run_pytest tests/image/test_api_contract.py
stop_clean "$API"
podman rm "$API" >/dev/null

# ---------------------------------------------------------------------------
step "router topology: start"
R0="attnserve-image-0"; R1="attnserve-image-1"; ROUTER="attnserve-image-router"
P0="$(free_port)"; P1="$(free_port)"; PR="$(free_port)"
start_service "$R0" "$P0"
start_service "$R1" "$P1"
# The per-deployment includes of deploy/nginx/attnserve.conf: compose's upstream
# lines with each host:port replaced by a loopback address (parameters kept), and
# where to listen and log.
NGX="$WORK/nginx"
mkdir -p "$NGX/attnserve" "$NGX/log"
chmod 0777 "$NGX/log"
"$PY" - "$ROOT/deploy/nginx/compose/upstreams.conf" "$NGX/attnserve/upstreams.conf" "127.0.0.1:$P0" "127.0.0.1:$P1" <<'PYEOF'
import re, sys
src, dst, *addresses = sys.argv[1:]
pattern = re.compile(r"^(\s*server\s+)(\S+)(.*)$", re.M)
text = open(src).read()
assert len(pattern.findall(text)) == len(addresses), "one compose upstream per replica"
it = iter(addresses)
open(dst, "w").write(pattern.sub(lambda m: f"{m.group(1)}{next(it)}{m.group(3)}", text))
PYEOF
printf 'listen 127.0.0.1:%s;\naccess_log /var/log/attnserve/access.log attnserve;\n' "$PR" >"$NGX/attnserve/server.conf"
chmod -R a+rX "$NGX/attnserve"
sed 's/^/  upstreams.conf: /' "$NGX/attnserve/upstreams.conf" | grep server
ROUTER_MOUNTS=(
  -v "$ROOT/deploy/nginx/attnserve.conf:/etc/nginx/conf.d/default.conf:ro"
  -v "$NGX/attnserve:/etc/nginx/attnserve:ro"
  -v "$NGX/log:/var/log/attnserve"
)
podman run --rm --network host "${RUN_LIMITS[@]}" "${ROUTER_MOUNTS[@]}" "$ROUTER_IMAGE" nginx -t 2>&1 | sed 's/^/  /'
wait_ready "$R0" "http://127.0.0.1:$P0"
wait_ready "$R1" "http://127.0.0.1:$P1"
CONTAINERS+=("$ROUTER")
podman run -d --name "$ROUTER" --label "$LABEL=$RUN_ID" --network host "${RUN_LIMITS[@]}" "${ROUTER_MOUNTS[@]}" \
  "$ROUTER_IMAGE" >/dev/null
for i in $(seq 60); do
  "$PY" deploy/healthcheck.py "http://127.0.0.1:$PR/_router/livez" 2>/dev/null && break
  [ "$i" = 60 ] && die "the router did not answer on 127.0.0.1:$PR"
  sleep 0.25
done
echo "router on http://127.0.0.1:$PR in front of $R0 (:$P0) and $R1 (:$P1)"

step "router topology: tests/image through the router"
ATTNSERVE_TEST_URL="http://127.0.0.1:$PR" ATTNSERVE_TEST_ADAPTER=llvmpipe \
  ATTNSERVE_TEST_REPLICAS="$R0=http://127.0.0.1:$P0,$R1=http://127.0.0.1:$P1" \
  ATTNSERVE_TEST_ROUTER_ACCESS_LOG="$NGX/log/access.log" \
  ATTNSERVE_TEST_STOP_REPLICA="podman stop -t 30 {name}" \
  run_pytest tests/image
echo "router access log: $(wc -l <"$NGX/log/access.log") requests"
for c in "$R0" "$R1"; do
  if [ "$(podman container inspect --format '{{.State.Running}}' "$c")" = true ]; then
    stop_clean "$c"
  else
    rc="$(podman container inspect --format '{{.State.ExitCode}}' "$c")"
    echo "$c was stopped by the tests, exit code $rc"
    [ "$rc" = 0 ] || [ "$rc" = 143 ] || die "$c exited with $rc on SIGTERM"
  fi
done
podman stop -t 10 "$ROUTER" >/dev/null

# ---------------------------------------------------------------------------
. deploy/image/test-compose.sh

step "done"
echo
echo "test-image: timings"
printf '  %s\n' "${TIMINGS[@]}"
printf '  %-54s %7s s\n' "total" "$(secs $(($(date +%s%3N) - START_MS)))"
echo "test-image: image $IMAGE, $((IMAGE_BYTES / 1000000)) MB; built from the Dockerfile, API checks passed on one container, through the router, and through docker-compose.yml run by podman-compose"
