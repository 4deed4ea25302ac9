#!/usr/bin/env bash
# Issue 28 on the lent H200, in two device calls:
#   bash bench/probes/h200_lse.sh tests OUT_DIR
#   bash bench/probes/h200_lse.sh kernels OUT_DIR OLD_TREE
# 1. tests: the log-sum-exp tests on the NVIDIA adapter (subgroup kernels included, which
#    lavapipe does not run): every kernel path's lse against the float64 oracle, the
#    API forms, merge, and the sharded session against two and three live servers;
# 2. kernels: what writing the lse costs the kernels: bench/kernel_bench.py (decode at 4k/32k/128k,
#    prefill 2048x2048 and 512x8192; f32 and tq4) of OLD_TREE (`git archive COMMIT
#    service client shaders bench tools`, before the lse) and of this tree, alternating
#    twice so the host's drift does not pass for a change.
set -u
MODE=${1:?tests or kernels}
OUTDIR=${2:?out dir}
export PYTHONUNBUFFERED=1
NEW=$(pwd)
if [ "$MODE" = tests ]; then
  # PYTEST_K: a -k selection; PYTEST_FILES: other test files
  ATTNSERVE_ADAPTER=nvidia timeout 560 python3 -m pytest -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} \
    ${PYTEST_FILES:-tests/test_core_attention.py tests/test_core_tqx.py tests/test_core_windowed.py \
    tests/test_core_columns.py tests/service/test_lse.py tests/client/test_merge.py tests/client/test_sharded.py} \
    2>&1 | grep -E "^(FAILED|ERROR)|passed|failed|^E  " | tail -n 40
  exit 0
fi
OLD=${3:?old tree}
for round in 1 2; do
  for tree in old new; do
    root=$NEW
    [ "$tree" = old ] && root=$OLD
    (cd "$root" && PYTHONPATH="/tmp/site:$root/service:$root/client:$root" timeout 120 python3 bench/kernel_bench.py \
      --adapter nvidia --formats f32,tq4 --only decode --batched "" --budget 0.2 \
      --json-out "$OUTDIR/kernels-decode-$tree-$round.json" >/dev/null 2>&1 \
      && PYTHONPATH="/tmp/site:$root/service:$root/client:$root" timeout 120 python3 bench/kernel_bench.py \
      --adapter nvidia --formats f32,tq4 --only prefill --budget 0.2 \
      --json-out "$OUTDIR/kernels-prefill-$tree-$round.json" >/dev/null 2>&1) || echo "kernels $tree $round failed"
  done
done
ls "$OUTDIR"
