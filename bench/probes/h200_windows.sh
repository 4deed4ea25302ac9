#!/usr/bin/env bash
# Exact sinks and a recent window (issue 27) on the lent H200, in two device calls:
#   bash bench/probes/h200_windows.sh kernels OUT_DIR
#     windowed decode against the same format without them (bench/kernel_bench.py, 32 query
#     heads, 8 KV heads, head_dim 128; 4k, 32k, 128k), and the windowed core tests on the GPU
#   bash bench/probes/h200_windows.sh e2e OUT_DIR GGUF NAME=SETTING@SEEDS ...
#     SmolLM2-135M end to end through the service over the long texts, the runs at
#     once (a server each; the float64 model on the host's cores)
set -u
MODE=${1:?kernels or e2e}
OUTDIR=${2:?out dir}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PYTHONPATH:$(pwd)"
if [ "$MODE" = kernels ]; then
  timeout 420 python3 bench/kernel_bench.py --adapter nvidia --only decode \
    --formats tq4,tq4/s4w128,tq4/s0w128,tq3,tq3/s4w128,turboquant,turboquant/s4w128 \
    --json-out "$OUTDIR/kernels-windows.json"
  if python3 -c "import pytest" 2>/dev/null; then
    ATTNSERVE_ADAPTER=nvidia timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_core_windowed.py | tail -n 3
  fi
  exit 0
fi
GGUF=${3:?gguf}
shift 3
# each further argument NAME=SETTING@SEEDS is one run (a server of its own), all at once:
# one seed a run keeps each within the call's limit, and writes its JSON
for spec in "${@:-a=tq4v3/s4w128@0,1}"; do
  name=${spec%%=*} rest=${spec#*=}
  OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4 timeout 560 python3 bench/e2e_model.py \
    --adapter nvidia --gguf "$GGUF" --formats "${rest%@*}" --seeds "${rest#*@}" \
    --texts moby-dick,pride-and-prejudice --chunk 512 --decode-tail 512 --bootstrap 1000 \
    --json-out "$OUTDIR/e2e-$name.json" > "$OUTDIR/e2e-$name.log" 2>&1 &
done
wait
tail -n 12 "$OUTDIR"/e2e-*.log
