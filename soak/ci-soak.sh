#!/usr/bin/env bash
# CI soak: about a minute of churn against a server of this checkout on loopback
# (Mesa's lavapipe when there is no GPU), over three tenants (API keys) when the
# server supports them; soak/soak.py exits non-zero on any failed request, any
# session that is no longer oracle-exact, GPU bytes that do not return to their
# level, server memory past the tolerance after the warm-up, or an error in the
# server's log. Its report: soak/out/ci-soak.json (and the server log beside it).
#   SOAK_DURATION (default 45) and SOAK_WARMUP (default 15) are seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
. deploy/_python.sh
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
OUT="${SOAK_OUT:-$ROOT/soak/out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/service:$ROOT/client${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import fastapi, uvicorn, wgpu, numpy, msgpack, httpx, pydantic_settings' 2>/dev/null; then
  echo "soak: installing the project's dependencies"
  pip_install -e ./client -e .
fi
. deploy/_adapter.sh
ensure_adapter "$PY"
# Tenants when this server has API keys (ATTNSERVE_API_KEYS), else one tenant.
TENANTS=1
if "$PY" -c 'import sys; from attnserve.config import Settings; sys.exit(0 if "api_keys" in Settings.model_fields else 1)'; then
  TENANTS=3
fi
exec "$PY" soak/soak.py --spawn --duration "${SOAK_DURATION:-45}" --warmup "${SOAK_WARMUP:-15}" \
  --tenants "$TENANTS" --workers 4 --log-dir "$OUT" --json-out "$OUT/ci-soak.json"
