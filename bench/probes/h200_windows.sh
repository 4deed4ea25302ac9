#!/usr/bin/env bash
# Exact sinks and a recent window (issue 27) on the lent H200, in two device calls:
#   bash bench/probes/h200_windows.sh kernels OUT_DIR
#     windowed decode against the same format without them (bench/kernels.py, 32 query
#     heads, 8 KV heads, head_dim 128; 4k, 32k, 128k), and the windowed core tests on the GPU
#   bash bench/probes/h200_windows.sh e2e OUT_DIR GGUF
#     SmolLM2-135M end to end through the service over the long texts, four settings'
#     runs at once (a server each; the float64 model on the host's cores)
set -u
MODE=${1:?kernels or e2e}
OUTDIR=${2:?out dir}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PYTHONPATH:$(pwd)"
if [ "$MODE" = kernels ]; then
  timeout 420 python3 bench/kernels.py --adapter nvidia --only decode \
    --formats tq4,tq4/s4w128,tq4/s0w128,tq3,tq3/s4w128,turboquant,turboquant/s4w128 \
    --json-out "$OUTDIR/kernels-windows.json"
  if python3 -c "import pytest" 2>/dev/null; then
    ATTNSERVE_ADAPTER=nvidia timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_core_windowed.py | tail -n 3
  fi
  exit 0
fi
GGUF=${3:?gguf}
run() {  # name, formats
  OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4 timeout 560 python3 bench/e2e_model.py \
    --adapter nvidia --gguf "$GGUF" --formats "$2" --seeds 0,1 --texts moby-dick,pride-and-prejudice \
    --chunk 512 --decode-tail 512 --bootstrap 1000 --json-out "$OUTDIR/e2e-$1.json" > "$OUTDIR/e2e-$1.log" 2>&1 &
}
run a tq4,tq4/s4w128
run b tq4v3/s4w128,tq3/s4w128
run c turboquant/s4w128,tq2o/s4w128
run d tq4/s0w128,tq3/s4w512
wait
tail -n 12 "$OUTDIR"/e2e-*.log
