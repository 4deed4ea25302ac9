#!/usr/bin/env bash
# Bootstrap and run attnserve on a fresh machine.
#   ./dev.sh serve [--host 127.0.0.1 --port 8000 ...]   start the service
#   ./dev.sh test  [pytest args]                         run the test suite
# Both create .venv (once), install the project with its test extras, and, when
# wgpu finds no adapter, install Mesa's software Vulkan driver through apt.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${ATTNSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  # Reinstall only when the project metadata changed.
  local stamp="$VENV/.attnserve-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ client/pyproject.toml -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    touch "$stamp"
  fi
}

has_adapter() {
  XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import sys, wgpu
sys.exit(0 if wgpu.gpu.enumerate_adapters_sync() else 1)
PYEOF
}

ensure_adapter() {
  if has_adapter; then return; fi
  echo "dev.sh: no wgpu adapter found; installing Mesa's software Vulkan driver (mesa-vulkan-drivers)" >&2
  local SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers >/dev/null
  if ! has_adapter; then
    echo "dev.sh: still no wgpu adapter after installing mesa-vulkan-drivers" >&2
    exit 1
  fi
}

cmd="${1:-}"
shift || true
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
case "$cmd" in
  serve)
    ensure_venv; ensure_adapter
    exec "$VENV/bin/attnserve" serve --host 127.0.0.1 "$@"
    ;;
  test)
    ensure_venv; ensure_adapter
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: $0 serve [attnserve serve options] | test [pytest options]" >&2
    exit 2
    ;;
esac
