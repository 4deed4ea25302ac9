#!/usr/bin/env bash
# Windowed layers as stacked-step columns (705e555) against the tree before them, on
# the lent H200, in one device call:
#   bash bench/probes/h200_windowed.sh OUT_DIR OLD_TREE
# OLD_TREE: a copy of this repository with service/ and shaders/ of the old commit
# (this tree's bench/ scripts run on both). tq4v3 with sinks 4 and a window of 128.
# 1. bench/probes/generate_step.py: the stacked decode call of 32 sessions of 30
#    layers at 1k (SmolLM2's shape), new and old, and f32 beside them (new);
# 2. bench/worker_profile.py --stacked: the GPU thread's plan / encode / submit of a
#    64 x 4k step, new and old (and f32, new, with its profile: what a plan reused
#    across layers could save), and 1 and 32 items at 1k (the fixed part of a step);
# 3. bench/step_profile.py: event loop and GPU thread CPU per item, 16 / 64 / 256 x 4k,
#    new and old;
# 4. the columns' tests on NVIDIA's Vulkan driver.
set -u
OUTDIR=${1:?out dir}
OLD=${2:?old tree}
NEW=$(pwd)
export PYTHONUNBUFFERED=1
W="--kv-format tq4v3 --sinks 4 --window 128"
in_tree() { (cd "$1" && shift && PYTHONPATH=/tmp/site "$@"); }
for tree in "$NEW new" "$OLD old"; do
  set -- $tree
  echo "== generate_step $2 tq4v3/s4w128"
  in_tree "$1" timeout 150 python3 bench/probes/generate_step.py --adapter nvidia --batch 32 --layers 30 \
    --context 1024 --calls 300 $W 2>&1 | grep variant
done
echo "== generate_step new f32"
in_tree "$NEW" timeout 120 python3 bench/probes/generate_step.py --adapter nvidia --batch 32 --layers 30 \
  --context 1024 --calls 300 2>&1 | grep variant
for tree in "$NEW new" "$OLD old"; do
  set -- $tree
  echo "== worker_profile $2 tq4v3/s4w128"
  in_tree "$1" timeout 100 python3 bench/worker_profile.py --adapter nvidia --stacked --sessions 64 --context 4096 \
    --steps 30 --formats tq4v3 --sinks 4 --window 128 --top 0 --json-out "$OUTDIR/worker-$2.json" | grep -v '^#'
done
echo "== worker_profile new f32 (profile)"
in_tree "$NEW" timeout 100 python3 bench/worker_profile.py --adapter nvidia --stacked --sessions 64 --context 4096 \
  --steps 30 --formats f32 --top 40 --sort tottime --json-out "$OUTDIR/worker-new-f32.json" | grep -v '^#'
echo "== worker_profile new f32, 1 and 32 items at 1k (generate()'s call: the fixed part of a step)"
in_tree "$NEW" timeout 60 python3 bench/worker_profile.py --adapter nvidia --stacked --sessions 32 --context 1024 \
  --steps 100 --formats f32 --top 0 | grep -v '^#'
for tree in "$NEW new" "$OLD old"; do
  set -- $tree
  echo "== step_profile $2 tq4v3/s4w128"
  in_tree "$1" timeout 170 python3 bench/step_profile.py --adapter nvidia --formats tq4v3 --sinks 4 --window 128 \
    --batches 16,64,256 --context 4096 --steps 20 --json-out "$OUTDIR/step-$2.json" | tail -n 4
done
echo "== tests on the H200"
in_tree "$NEW" env PYTHONPATH=/tmp/site:$NEW/service:$NEW/client:$NEW ATTNSERVE_ADAPTER=nvidia timeout 150 \
  python3 -m pytest -q -p no:cacheprovider tests/test_core_columns.py tests/test_step_groups.py 2>&1 | tail -n 3
