#!/usr/bin/env bash
# The longer load runs behind docs/deploy.md's results table: one attnserve server
# on this host's GPU (or on lavapipe), the load generator beside it on loopback.
#
#   bash loadtest/bench.sh                                   # this machine (lavapipe), profile small
#   bash loadtest/bench.sh --adapter nvidia --profile all    # a GPU host: small and large
#   bash loadtest/bench.sh --adapter nvidia --profile large --batched --replicas 8
#                                            # engine-shaped, 8 replicas behind the router
#
# Options: --adapter SEL (ATTNSERVE_ADAPTER: index, backend, type or part of the name;
# default: the first adapter), --profile small|large|all, --duration S (each run's
# measured load, default 45), --warmup-s S (each run's warm-up before it, not measured:
# first-use kernel compiles; default 5), --workers N (load processes, default: 4 with
# >= 8 cores, else 1), --out DIR (default loadtest/out/bench), --budget BYTES (the
# server's memory budget, split among replicas), --formats LIST (default
# f32,turboquant), --batched (each load process an engine: one stacked batched step
# per layer for all its sessions; closed loop only), --replicas N (N servers on the
# adapter behind the compose router, nginx with deploy/nginx/attnserve.conf, run by
# tools/router.py; default 1: no router), --nginx BIN (the nginx binary for
# --replicas > 1; default: on PATH).
#
# Per profile and kv format, two runs: closed loop, then (not --batched) open loop
# at 60 % of the decode tokens/s the closed loop reached. Writes into --out:
#   results.md     the table rows for docs/deploy.md, and the adapters seen
#   results.json   every run's report (loadtest.py --json-out), in one list
#   <run>.png      each closed-loop run's latency plot (histogram, latency over time)
#   server.log     the server's log
# (at most 7 files: what the lent machine's $OUT gives back is 8)
# Exits non-zero when a run had an error.
#
# On the lent H200 machine (no network; see docs/deploy.md): it unpacks the Vulkan
# loader from .gl/*.deb and installs .whl/*.whl into /tmp/site when they are needed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

ADAPTER=""; PROFILE="small"; DURATION=45; WARMUP=5; WORKERS=""; OUTDIR="$ROOT/loadtest/out/bench"; BUDGET=""
FORMATS="f32,turboquant"; BATCHED=""; REPLICAS=1; NGINX=""
while [ $# -gt 0 ]; do
  case "$1" in
    --adapter) ADAPTER="$2"; shift 2 ;;
    --profile) PROFILE="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --warmup-s) WARMUP="$2"; shift 2 ;;
    --workers) WORKERS="$2"; shift 2 ;;
    --out) OUTDIR="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --formats) FORMATS="$2"; shift 2 ;;
    --batched) BATCHED="--batched"; shift ;;
    --replicas) REPLICAS="$2"; shift 2 ;;
    --nginx) NGINX="$2"; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "bench: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$PROFILE" in small) PROFILES="small" ;; large) PROFILES="large" ;; all) PROFILES="small large" ;;
  *) echo "bench: --profile small|large|all" >&2; exit 2 ;; esac
if [ -z "$WORKERS" ]; then
  if [ "$(nproc)" -ge 8 ]; then WORKERS=4; else WORKERS=1; fi
fi
mkdir -p "$OUTDIR"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi

# A machine without network (the lent GPU hosts): the Vulkan loader and the Python
# packages that its image lacks travel in .gl/ and .whl/ (docs/deploy.md).
LIBS="$(ldconfig -p 2>/dev/null || true)"
if [ -d .gl ] && ! printf '%s\n' "$LIBS" | grep -q 'libvulkan.so.1'; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
export PYTHONPATH="$ROOT/service:$ROOT/client${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import fastapi, uvicorn, wgpu, msgpack, httpx, pydantic_settings' 2>/dev/null && [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ! "$PY" -c 'import fastapi, uvicorn, wgpu, msgpack, httpx, pydantic_settings, matplotlib' 2>&1; then
  echo "bench: Python packages missing (see docs/deploy.md, 'Load test on the H200 host')" >&2
  exit 2
fi
SEEN="$("$PY" -m attnserve adapters 2>/dev/null || true)"
if [ -n "$ADAPTER" ] && ! printf '%s\n' "$SEEN" | grep -qi -- "$ADAPTER"; then
  for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
             /etc/vulkan/icd.d/nvidia_icd.json; do
    if [ -f "$icd" ]; then export VK_DRIVER_FILES="$icd"; break; fi
  done
  egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  if [ -f "$egl" ]; then export __EGL_VENDOR_LIBRARY_FILENAMES="$egl"; fi
fi
ADAPTERS="$("$PY" -m attnserve adapters || true)"
echo "$ADAPTERS"

if [ -z "$BUDGET" ]; then
  if [ -n "$ADAPTER" ]; then BUDGET=$((64 << 30)); else BUDGET=$((4 << 30)); fi
fi
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PIDS=()
trap 'kill -TERM "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
ADDRESSES=(); METRICS=()
: >"$OUTDIR/server.log"
for r in $(seq 0 $((REPLICAS - 1))); do
  PORT="$(free_port)"
  ADDRESSES+=("127.0.0.1:$PORT"); METRICS+=(--metrics-url "http://127.0.0.1:$PORT")
  ATTNSERVE_ADAPTER="$ADAPTER" ATTNSERVE_MEMORY_BUDGET_BYTES=$((BUDGET / REPLICAS)) ATTNSERVE_INSTANCE_NAME="bench-$r" \
    ATTNSERVE_LOG_LEVEL=warning ATTNSERVE_MAX_SESSIONS=4096 \
    "$PY" -m attnserve serve --host 127.0.0.1 --port "$PORT" >>"$OUTDIR/server.log" 2>&1 &
  PIDS+=($!)
done
for a in "${ADDRESSES[@]}"; do
  for i in $(seq 240); do
    if "$PY" deploy/healthcheck.py "http://$a/readyz" 2>/dev/null; then break; fi
    if [ "$i" = 240 ]; then
      echo "bench: the server on $a did not become ready:" >&2; tail -n 40 "$OUTDIR/server.log" >&2; exit 1
    fi
    sleep 0.5
  done
done
if [ "$REPLICAS" -gt 1 ]; then
  PORT="$(free_port)"
  rm -rf "$OUTDIR/router"
  "$PY" -m tools.router ${NGINX:+--nginx "$NGINX"} --port "$PORT" --workdir "$OUTDIR/router" "${ADDRESSES[@]}" \
    >>"$OUTDIR/server.log" 2>&1 &
  PIDS+=($!)
  for i in $(seq 60); do
    if "$PY" deploy/healthcheck.py "http://127.0.0.1:$PORT/_router/livez" 2>/dev/null; then break; fi
    if [ "$i" = 60 ]; then echo "bench: the router did not start:" >&2; tail -n 40 "$OUTDIR/server.log" >&2; exit 1; fi
    sleep 0.5
  done
  URL="http://127.0.0.1:$PORT"
else
  URL="http://${ADDRESSES[0]}"; METRICS=()
fi

profile_args() {
  case "$1" in
    # A few small heads: per-request overhead (HTTP, msgpack, one GPU submit) dominates.
    small) echo "--sessions 8 --layers 4 --qo-heads 8 --kv-heads 2 --head-dim 64 --prefill 128 --chunk 64 --decode-steps 64" ;;
    # A 7B-class layer shape (32 query, 8 KV heads of 128), 1k-token prompts, 32 sessions.
    large) echo "--sessions 32 --layers 4 --qo-heads 32 --kv-heads 8 --head-dim 128 --prefill 1024 --chunk 256 --decode-steps 256" ;;
  esac
}

FAILED=0
RUNS=()
for prof in $PROFILES; do
  for fmt in ${FORMATS//,/ }; do
    name="$prof-$fmt-closed${BATCHED:+-batched}"
    echo; echo "== $name"
    # shellcheck disable=SC2046
    "$PY" loadtest/loadtest.py --url "$URL" $(profile_args "$prof") --kv-format "$fmt" $BATCHED "${METRICS[@]}" \
      --duration "$DURATION" --warmup-s "$WARMUP" --workers "$WORKERS" --seed 7 --timeout 120 --progress log \
      --json-out "$OUTDIR/$name.json" --plot "$OUTDIR/$name.png" || FAILED=1
    RUNS+=("$name")
    [ -n "$BATCHED" ] && continue  # an engine steps when it can: no open loop
    rate="$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(round(0.6*r["throughput"]["decode_tokens_per_s"], 1))' "$OUTDIR/$name.json" 2>/dev/null || echo 0)"
    if [ "${rate%.*}" -ge 1 ] 2>/dev/null; then
      name="$prof-$fmt-open"
      echo; echo "== $name at $rate decode steps/s"
      # shellcheck disable=SC2046
      "$PY" loadtest/loadtest.py --url "$URL" $(profile_args "$prof") --kv-format "$fmt" \
        --duration "$DURATION" --warmup-s "$WARMUP" --workers "$WORKERS" --seed 8 --timeout 120 --progress log \
        --mode open --rate "$rate" --json-out "$OUTDIR/$name.json" || FAILED=1
      RUNS+=("$name")
    fi
  done
done

ADAPTERS="$ADAPTERS" WORKERS="$WORKERS" REPLICAS="$REPLICAS" WARMUP="$WARMUP" "$PY" - "$OUTDIR" "${RUNS[@]}" <<'PYEOF'
import json, os, platform, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), sys.argv[2:]
reports = []
rows = []
for name in runs:
    path = out / f"{name}.json"
    if not path.exists():
        continue
    r = json.loads(path.read_text())
    for m in r.get("server_metrics", {}).values():  # keep the deltas, drop the full scrapes
        m.pop("before", None); m.pop("after", None)
    r["name"] = name
    reports.append(r)
    c, ops, th = r["config"], r["operations"], r["throughput"]
    adapter = (r.get("server") or {}).get("adapter", {}).get("name", "?")
    def ms(op, q, ops=ops):  # --batched runs time one batched step per layer instead
        batched = {"decode": "decode_batch", "prefill_chunk": "prefill_batch"}
        o = ops[batched.get(op, op) if c.get("batched") else op]
        return "-" if not o or o[q] is None else f"{o[q]:.1f}"
    loop = ("closed" if c["mode"] == "closed" else f"open {c['rate']:g}/s") + (", batched" if c.get("batched") else "")
    rows.append(
        f"| {adapter} | {name.split('-')[0]} | {c['kv_format']} | {loop} | {c['sessions']} "
        f"| {th['decode_tokens_per_s']:.1f} | {th['attends_per_s']:.1f} | {th['prefill_tokens_per_s']:.0f} "
        f"| {ms('decode_step', 'p50_ms')} / {ms('decode_step', 'p99_ms')} "
        f"| {ms('decode', 'p50_ms')} / {ms('decode', 'p99_ms')} "
        f"| {ms('prefill_chunk', 'p50_ms')} / {ms('prefill_chunk', 'p99_ms')} | {r['error_count']} |"
    )
for name in runs:
    (out / f"{name}.json").unlink(missing_ok=True)  # all of them are in results.json
(out / "results.json").write_text(json.dumps(reports, indent=1) + "\n")
head = ("| adapter | profile | kv | loop | sessions | decode tok/s | attends/s | prefill tok/s "
        "| step p50 / p99 ms | decode attend (batched: layer step) p50 / p99 ms | prefill chunk (batched: layer step) p50 / p99 ms | errors |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|")
note = (f"\n{platform.node()}: {os.cpu_count()} cores, {os.environ['REPLICAS']} server replica(s)"
        f"{' behind the router' if int(os.environ['REPLICAS']) > 1 else ''}, "
        f"{os.environ['WORKERS']} load process(es), each run measured after a {os.environ['WARMUP']} s warm-up; "
        "adapters:\n"
        + "".join(f"    {line}\n" for line in os.environ.get("ADAPTERS", "").splitlines()))
(out / "results.md").write_text(head + "\n" + "\n".join(rows) + "\n" + note)
print("\n" + head + "\n" + "\n".join(rows))
PYEOF
echo
echo "bench: results in $OUTDIR (results.md, results.json, *.png, server.log)"
exit "$FAILED"
