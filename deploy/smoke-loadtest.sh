#!/usr/bin/env bash
# CI smoke run of the load test: one real server on loopback (Mesa's lavapipe when
# there is no GPU), then loadtest/loadtest.py for a few seconds per kv format, each
# after a 2 s warm-up (not measured; the report must say so):
#   f32          closed loop, 10 % of decode outputs checked against float64
#   turboquant   open loop at 40 decode steps/s
# Each run must end with no error (the load test exits 1 otherwise), write its JSON
# report and PNG plot (loadtest/out/smoke-*.{json,png}), and the server must stop
# cleanly on SIGTERM. Idempotent; installs what is missing (the project's
# dependencies, matplotlib, mesa-vulkan-drivers). About 30 s on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
. deploy/_python.sh
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
OUT="${SMOKE_OUT:-$ROOT/loadtest/out}"
DURATION="${SMOKE_DURATION:-6}"
mkdir -p "$OUT"

# The checkout's packages, whatever is installed.
export PYTHONPATH="$ROOT/service:$ROOT/client${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import fastapi, uvicorn, wgpu, numpy, msgpack, httpx, pydantic_settings' 2>/dev/null; then
  echo "smoke: installing the project's dependencies"
  pip_install -e .
fi
if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
  echo "smoke: installing matplotlib (the project's [bench] extra)"
  pip_install 'matplotlib>=3.7'
fi
. deploy/_adapter.sh
ensure_adapter "$PY"

PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
ATTNSERVE_INSTANCE_NAME=smoke ATTNSERVE_LOG_LEVEL=warning \
  "$PY" -m attnserve serve --host 127.0.0.1 --port "$PORT" >"$OUT/smoke-server.log" 2>&1 &
SERVER=$!
stop_server() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER" 2>/dev/null || true
  fi
}
trap stop_server EXIT

# up to 120 s: ready after the kernels' warm-up (a minute where Mesa's shader cache is empty)
for i in $(seq 240); do
  if "$PY" deploy/healthcheck.py "$URL/readyz" 2>/dev/null; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null || [ "$i" = 240 ]; then
    echo "smoke: the server did not become ready; its log:" >&2
    cat "$OUT/smoke-server.log" >&2
    exit 1
  fi
  sleep 0.5
done
echo "smoke: server ready on $URL"

echo; echo "== f32, closed loop, verified"
"$PY" loadtest/loadtest.py --url "$URL" --duration "$DURATION" --sessions 4 --layers 2 \
  --prefill 64 --chunk 32 --decode-steps 24 --kv-format f32 --verify 0.1 --seed 1 --warmup-s 2 \
  --progress log --json-out "$OUT/smoke-f32.json" --plot "$OUT/smoke-f32.png"

echo; echo "== turboquant, open loop"
"$PY" loadtest/loadtest.py --url "$URL" --duration "$DURATION" --sessions 4 --layers 2 \
  --prefill 64 --chunk 32 --decode-steps 24 --kv-format turboquant --mode open --rate 40 --seed 2 --warmup-s 2 \
  --progress log --json-out "$OUT/smoke-turboquant.json" --plot "$OUT/smoke-turboquant.png"

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for fmt in ("f32", "turboquant"):
    report = json.loads((out / f"smoke-{fmt}.json").read_text())
    ops = report["operations"]
    assert report["error_count"] == 0, report["errors"]
    assert ops["decode_step"]["count"] > 0 and ops["prefill_chunk"]["count"] > 0, ops
    assert report["totals"]["sessions_started"] >= 4, report["totals"]
    assert report["warmup"]["seconds"] == 2 and report["warmup"]["requests"] > 0, report["warmup"]
    metrics = next(iter(report["server_metrics"].values()))
    assert "delta" in metrics, metrics
    png = (out / f"smoke-{fmt}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, "no plot"
    if fmt == "f32":
        assert report["verify"]["checked"] > 0 and report["verify"]["failed"] == 0, report["verify"]
print("smoke: reports, plots and checks ok")
PYEOF

# SIGTERM: the server drains and exits; uvicorn re-raises the signal on the way
# out, so 143 (128 + SIGTERM) is a clean stop as much as 0 is.
kill -TERM "$SERVER"
rc=0; wait "$SERVER" || rc=$?
trap - EXIT
if [ "$rc" != 0 ] && [ "$rc" != 143 ]; then
  echo "smoke: the server exited with $rc on SIGTERM; its log:" >&2
  tail -n 30 "$OUT/smoke-server.log" >&2
  exit 1
fi
echo "smoke: passed"
