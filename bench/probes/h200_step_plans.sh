#!/usr/bin/env bash
# A stacked step's plan recorded on its first layer and replayed on the others
# (batch.StepPlans, issue 25 item 2) against the tree before it, on the lent H200,
# in one device call:
#   bash bench/probes/h200_step_plans.sh OUT_DIR OLD_TREE
# OLD_TREE: a copy of this repository at the commit before (this tree's bench/
# scripts run on both).
# 1. bench/worker_profile.py --layers 30: the GPU thread's plan / encode of 1 and of
#    32 items at 1k, the layers in turn (29 of 30 replayed), new and old, f32 and tq4;
#    and --layers 1 (every step records: what recording costs);
# 2. bench/probes/generate_step.py: the stacked decode call of 32 sessions of 30
#    layers at 1k over the stream ("cycle": the layers in turn, as generate() sends
#    them; "same": always layer 0, so every call records), new and old, f32 and tq4;
# 3. the columns' tests on NVIDIA's Vulkan driver.
set -u
OUTDIR=${1:?out dir}
OLD=${2:?old tree}
NEW=$(pwd)
export PYTHONUNBUFFERED=1
in_tree() { (cd "$1" && shift && PYTHONPATH=/tmp/site "$@"); }
for layers in 30 1; do
  for tree in "$NEW new" "$OLD old"; do
    set -- $tree
    echo "== worker_profile $2 layers $layers"
    in_tree "$1" timeout 90 python3 bench/worker_profile.py --adapter nvidia --stacked --sessions 32 --context 1024 \
      --steps 150 --formats f32,tq4 --top 0 --layers $layers --json-out "$OUTDIR/worker-$2-$layers.json" | grep -v '^#'
  done
done
for fmt in f32 tq4; do
  for tree in "$NEW new" "$OLD old"; do
    set -- $tree
    echo "== generate_step $2 $fmt"
    in_tree "$1" timeout 120 python3 bench/probes/generate_step.py --adapter nvidia --batch 32 --layers 30 \
      --context 1024 --calls 300 --kv-format $fmt 2>&1 | grep variant
  done
done
echo "== tests on the H200"
in_tree "$NEW" env PYTHONPATH=/tmp/site:$NEW/service:$NEW/client:$NEW ATTNSERVE_ADAPTER=nvidia timeout 150 \
  python3 -m pytest -q -p no:cacheprovider tests/test_core_columns.py 2>&1 | tail -n 3
