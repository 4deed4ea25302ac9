#!/usr/bin/env bash
# transformers' generate() on attnserve (issue 29) on the lent H200, in two device calls:
#   bash bench/probes/h200_generate.sh tests OUT_DIR
#     the client's torch and transformers tests against a live server on the H200 (the
#     CUDA tensor test runs there: torch has CUDA)
#   bash bench/probes/h200_generate.sh step OUT_DIR
#     bench/probes/generate_step.py: the stacked decode call of 32 (and 1) sessions of 30
#     layers at 1k, alone, with the layers in turn, and with torch's work in the process
#   bash bench/probes/h200_generate.sh bench OUT_DIR GGUF
#     bench/generate.py: batch 1 and 32, prompt 1,024, 256 new tokens, sdpa beside
#     attnserve f32 and tq4v3/s4w128; then the formats' fidelity through transformers
#   bash bench/probes/h200_generate.sh fidelity OUT_DIR GGUF
#     the formats' fidelity through transformers alone
#   bash bench/probes/h200_generate.sh micro OUT_DIR
#     micro-batches in flight (issue 43 item 5): a random SmolLM2-shaped model in float32,
#     batch 32 and 1, prompt 1,024, 64 new tokens: sdpa, generate() on attnserve f32, and
#     generate_overlapped unsplit (mb1) and in 2 micro-batches (mb2), over the frame transport
set -u
MODE=${1:?tests or bench}
OUTDIR=${2:?out dir}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PYTHONPATH:$(pwd)"
if [ "$MODE" = tests ]; then
  ATTNSERVE_ADAPTER=nvidia timeout 300 python3 -m pytest -q -p no:cacheprovider tests/client/test_tensors.py tests/client/test_transformers.py \
    -k "not smollm2 and not documented" 2>&1 | tail -n 4
  exit 0
fi
if [ "$MODE" = step ]; then  # the stacked decode call alone, as the cache sends it
  for shape in "32 30" "1 30"; do
    set -- $shape
    timeout 150 python3 bench/probes/generate_step.py --adapter nvidia --batch $1 --layers $2 --context 1024 --calls 300 \
      2>&1 | grep variant
  done
  exit 0
fi
if [ "$MODE" = micro ]; then
  timeout 560 python3 bench/generate.py --adapter nvidia --random smollm2-135m --dtype float32 --batches 32,1 \
    --prompt 1024 --new 64 --settings f32 --micro-batches 1,2 --transport frames --out "$OUTDIR/generate-micro.json" 2>&1
  exit 0
fi
GGUF=${3:?gguf}
[ "$MODE" = fidelity ] || timeout 560 python3 bench/generate.py --adapter nvidia --gguf "$GGUF" --batches 1,32 --prompt 1024 --new 256 \
  --settings f32,tq4v3/s4w128 --out "$OUTDIR/generate.json" 2>&1 | grep -v "Converting\|Loading weights"
# every format alone, then the windowed settings (about 10 s each on the H200)
timeout 400 python3 bench/generate.py --adapter nvidia --gguf "$GGUF" --batches "" \
  --fidelity f32,f16,bf16,turboquant,tq4,tq3,tq4v2,tq4v3,tq3q,tq4q,tq4o,tq3o,tq2o,tq4v3/s4w128,tq4/s4w128,turboquant/s4w128 \
  --out "$OUTDIR/generate-fidelity.json" 2>&1 \
  | grep -v "Converting\|Loading weights"
