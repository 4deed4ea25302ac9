#!/usr/bin/env bash
# Issue 25's host-time measures on the lent H200, in stages that fit one device call
# each (10 minutes):
#   bash bench/probes/h200_host_time.sh OUT_DIR OLD_TREE STAGE...
# OLD_TREE holds service/, client/, shaders/, bench/ and tools/ of the commit to
# compare with (git archive COMMIT service client shaders bench tools | tar -x -C DIR),
# or "-". Stages (each writes its JSON into OUT_DIR):
#   profile      bench/step_profile.py (16, 64, 256 sessions x 4k, f32 and turboquant)
#                on this tree, then on this tree with ATTNSERVE_GC_THRESHOLD=0 (Python's
#                collector: the gc policy's share), then on OLD_TREE
#   service      bench/service.py (stacked steps of 64 x 4k: HTTP, the stream, 4 in
#                flight; single fused steps), this tree then OLD_TREE
#   service256   bench/service.py's stacked steps of 256 x 4k, this tree
#   worker       bench/worker_profile.py --stacked (the GPU thread's plan / encode /
#                submit + readback of one 64 x 4k step), this tree
#   generic      bench/generic_clients.py (plain websockets and httpx clients), this tree
#   load         loadtest/bench.sh --profile large --batched (engine-shaped, one server
#                process), this tree
set -u
OUTDIR=${1:?out dir}
OLD=${2:?old tree, or -}
shift 2
NEW=$(pwd)
export PYTHONUNBUFFERED=1
run() {  # run TREE SECONDS SCRIPT ARGS... : a bench script of TREE, cut at SECONDS
  local tree=$1 secs=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$PYTHONPATH:$tree/service:$tree/client:$tree" timeout "$secs" python3 "$@")
}
profile() {  # profile TREE LABEL
  echo "== step_profile $2"
  run "$1" 170 bench/step_profile.py --adapter nvidia --batches 16,64,256 --context 4096 --steps 20 \
    --json-out "$OUTDIR/profile-$2.json" | tail -n 6
}
service() {  # service TREE LABEL [SESSIONS]
  echo "== service $2"
  run "$1" 200 bench/service.py --adapter nvidia --skip-threads --forms stacked --seconds 4 --steps 150 \
    --sessions "${3:-64}" --json-out "$OUTDIR/service-$2.json" | grep -v '^#' | tail -n 30
}
for stage in "$@"; do
  case "$stage" in
    profile)
      profile "$NEW" new
      ATTNSERVE_GC_THRESHOLD=0 profile "$NEW" new-gc-off
      [ "$OLD" = - ] || profile "$(cd "$OLD" && pwd)" old ;;
    service)
      service "$NEW" new
      [ "$OLD" = - ] || service "$(cd "$OLD" && pwd)" old ;;
    service256) service "$NEW" new-256 256 ;;
    worker)
      echo "== worker_profile"
      run "$NEW" 150 bench/worker_profile.py --adapter nvidia --stacked --sessions 64 --context 4096 --steps 30 \
        --top 25 --json-out "$OUTDIR/worker-new.json" | grep -v '^#' | head -n 45 ;;
    generic)
      echo "== generic clients"
      run "$NEW" 200 bench/generic_clients.py --adapter nvidia --json-out "$OUTDIR/generic-new.json" | tail -n 20 ;;
    load)
      echo "== large load profile"
      timeout 300 bash loadtest/bench.sh --adapter nvidia --profile large --batched --duration 30 \
        --out "$OUTDIR/load" | tail -n 20 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
