#!/usr/bin/env bash
# The columnar step (issue 25) against the tree before it, in one device call:
#   bash bench/probes/h200_columnar.sh OLD_TREE OUT_DIR
# OLD_TREE holds service/, client/, shaders/, bench/ and tools/ of the commit to
# compare with (git archive COMMIT service client shaders bench tools | tar -x -C DIR);
# each tree runs bench/service.py (stacked steps of 64 sessions x 4k: HTTP, the
# stream, 4 batches in flight; single fused steps) and bench/step_profile.py
# (16, 64 and 256 sessions: host time per stage and its fit), then this tree runs
# bench/generic_clients.py (plain websockets and httpx clients) and
# bench/worker_profile.py --stacked (the GPU thread's plan / encode / submit +
# readback of one stacked step). OLD_TREE "-": this tree only. JSON lands in OUT_DIR.
set -u
OLD=${1:?old tree, or -}
OUTDIR=${2:?out dir}
NEW=$(pwd)
export PYTHONUNBUFFERED=1
bench() {  # bench TREE LABEL
  local tree=$1 label=$2
  echo "== $label: $tree"
  (cd "$tree" && PYTHONPATH="$PYTHONPATH:$tree/service:$tree/client:$tree" timeout 300 python3 bench/service.py \
    --adapter nvidia --skip-threads --forms stacked --seconds 5 --steps 150 --sessions 64 \
    --json-out "$OUTDIR/service-$label.json" | grep -v '^#' | tail -n 40)
  (cd "$tree" && PYTHONPATH="$PYTHONPATH:$tree/service:$tree/client:$tree" timeout 300 python3 bench/step_profile.py \
    --adapter nvidia --batches 16,64,256 --context 4096 --steps 30 --json-out "$OUTDIR/profile-$label.json" | tail -n 12)
}
[ "$OLD" = - ] || bench "$(cd "$OLD" && pwd)" old
bench "$NEW" new
(cd "$NEW" && PYTHONPATH="$PYTHONPATH:$NEW/service:$NEW/client:$NEW" timeout 150 python3 bench/worker_profile.py \
  --adapter nvidia --stacked --sessions 64 --context 4096 --steps 30 --top 25 --json-out "$OUTDIR/worker-new.json" \
  | grep -v '^#' | head -n 60)
(cd "$NEW" && PYTHONPATH="$PYTHONPATH:$NEW/service:$NEW/client:$NEW" timeout 200 python3 bench/generic_clients.py \
  --adapter nvidia --json-out "$OUTDIR/generic-new.json" | tail -n 20)
