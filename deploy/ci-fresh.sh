#!/usr/bin/env bash
# .ci/run as on a NEW machine: remove what CI's scripts install (so a missing
# install step fails here, not only on a new machine), then run .ci/run on a
# fresh clone of this checkout's HEAD.
#
#   bash deploy/ci-fresh.sh --yes [CLONE_DIR]        (as root; default CLONE_DIR /tmp/attnserve-ci-fresh)
#
# Removed first: the Debian packages the scripts install (podman, runc,
# debootstrap, the containers' network plugins, conmon, Mesa's Vulkan driver,
# nginx), podman's image and container storage, the image cache of
# deploy/test-image.sh, pip's cache; the clone has no venv. It does not touch
# Python itself or anything a new machine of this kind already has.
# DESTRUCTIVE for a developer machine (it purges those packages): hence --yes.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
[ "${1:-}" = --yes ] || { sed -n '2,13p' "$0"; echo "ci-fresh: pass --yes to run" >&2; exit 2; }
shift
[ "$(id -u)" = 0 ] || { echo "ci-fresh: run as root" >&2; exit 2; }
DEST="${1:-/tmp/attnserve-ci-fresh}"
PACKAGES=(podman runc debootstrap conmon containernetworking-plugins golang-github-containernetworking-plugin-dnsname
          mesa-vulkan-drivers nginx nginx-common nginx-core)

echo "== removing what CI installs"
if type -P podman >/dev/null 2>&1; then
  podman rm -af -t 1 >/dev/null 2>&1 || true
  podman system reset -f >/dev/null 2>&1 || true
fi
installed=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 && installed+=("$p")
done
if [ "${#installed[@]}" -gt 0 ]; then
  echo "purging ${installed[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${installed[@]}" >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get autoremove -y -qq >/dev/null
fi
rm -rf /var/cache/attnserve-image /var/lib/containers /root/.cache/pip
hash -r  # forget where bash found the purged programs
for tool in podman runc debootstrap nginx; do
  if type -P "$tool" >/dev/null 2>&1; then echo "ci-fresh: $tool is still on PATH" >&2; exit 1; fi
done
if dpkg -s mesa-vulkan-drivers >/dev/null 2>&1; then echo "ci-fresh: lavapipe still installed" >&2; exit 1; fi
echo "none of podman, runc, debootstrap, nginx, lavapipe, the image cache, pip's cache is left"

echo "== fresh clone of $(git -C "$ROOT" rev-parse --short HEAD) into $DEST"
rm -rf "$DEST"
git clone -q "$ROOT" "$DEST"
cd "$DEST"
echo "== CI=true bash .ci/run"
CI=true bash .ci/run
