#!/usr/bin/env bash
# Issue 43 item 3 on the lent H200: where a call's fixed cost goes, in stages that
# each fit a device call:
#   TRANSPORT_PROBE=PATH OLD_TREE=DIR bash bench/probes/h200_fixed_cost.sh OUT STAGE...
# floors:   the stack's floors (the shared transport probe at TRANSPORT_PROBE: FastAPI
#           echo over HTTP and WebSocket, a tiny wgpu submit + readback);
# readback: bench/probes/readback_probe.py: a tiny submission phase by phase, for each
#           way of waiting for the map, alone and beside a busy Python thread, under
#           the default and a 0.5 ms GIL switch interval;
# worker:   bench/worker_profile.py --stacked: the GPU thread's plan / encode / submit /
#           readback of a fused decode step (32 q / 8 KV heads of 128, f32, 4k) of 1
#           and of 32 sessions;
# service:  bench/service.py: stacked steps of 32 sessions x 4k over HTTP, the stream
#           and the frames, and the single fused step (p50 per call), with float32 and
#           with bfloat16 arrays (DTYPES, default f32,bf16);
# profile:  bench/step_profile.py: host CPU per thread of stacked steps of 1, 32 and 64
#           sessions x 4k over the frames, fitted per item and fixed, f32 and bf16;
# generate: bench/generate.py on random models (--random): smollm2-135m in float32 and
#           bfloat16 at batch 1 and 32 x 1,024, and llama3-8b in bfloat16 at batch 1 and
#           32 x 4,096 (NEW tokens each, default 64), sdpa beside attnserve f32 over the frames;
# ab:       the single fused decode step of OLD_TREE's server and this tree's in turn
#           (bench/probes/ab_single.py);
# build:    this tree's C extension, built in place (python3 setup.py build_ext --inplace:
#           the device runs the checkout from PYTHONPATH, with no pip install);
# abservice: the service stage (frames only, f32 and bf16) run by OLD_TREE's bench and
#           server, then by this tree's, twice in turn;
# abworker: the worker stage, OLD_TREE's then this tree's;
# timeline: bench/probes/call_timeline.py: a layer call stage by stage on both sides of
#           the frames (32 q / 8 KV heads of 128 at 4k: 1 session of 30 layers and 32 of
#           4, f32 and bf16 arrays; SmolLM2-135M's shape, 9 q / 3 KV heads of 64, at 1k,
#           32 sessions of 30 layers), the layers stepped in turn.
set -uo pipefail
OUT=${1:?OUT}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    floors) timeout 120 python3 "${TRANSPORT_PROBE:?}" "$OUT/transport_probe.json" > "$OUT/transport_probe.log" 2>&1
            tail -3 "$OUT/transport_probe.log"; cat "$OUT/transport_probe.json" ;;
    readback) timeout 200 python3 bench/probes/readback_probe.py --adapter nvidia --iters 3000 \
                --json-out "$OUT/readback.json" 2>&1 | grep -v "^ \|^{\|^}" ;;
    worker) for n in 1 32; do
              timeout 150 python3 bench/worker_profile.py --adapter nvidia --sessions $n --context 4096 --stacked \
                --steps 300 --formats f32 2>&1 | tail -2 | tee "$OUT/worker_$n.txt"
            done ;;
    service) timeout 280 python3 bench/service.py --adapter nvidia --context 4096 --steps 200 --sessions 32 \
               --formats f32 --skip-threads --transports ${TRANSPORTS:-http,stream,frames} --forms stacked \
               --dtypes ${DTYPES:-f32,bf16} --seconds ${SECONDS_EACH:-8} --pipeline 1 \
               --json-out "$OUT/service.json" > "$OUT/service.log" 2>&1
             tail -30 "$OUT/service.log" ;;
    profile) for dt in f32 bf16; do
               timeout 200 python3 bench/step_profile.py --adapter nvidia --batches 1,32,64 --context 4096 \
                 --formats f32 --transport frames --dtype $dt --steps 100 --json-out "$OUT/profile_$dt.json" 2>&1 \
                 | grep -v Warning | tail -5
             done ;;
    generate) for dt in float32 bfloat16; do
                timeout 240 python3 bench/generate.py --adapter nvidia --random smollm2-135m --dtype $dt --batches 1,32 \
                  --prompt 1024 --new ${NEW:-64} --settings f32 --transport frames --out "$OUT/generate_smollm2_$dt.json" 2>&1 \
                  | grep setting
              done
              timeout 400 python3 bench/generate.py --adapter nvidia --random llama3-8b --dtype bfloat16 --batches 1,32 \
                --prompt 4096 --new ${NEW:-64} --settings f32 --transport frames --out "$OUT/generate_llama3_8b.json" 2>&1 \
                | grep setting ;;
    timeline) for dt in f32 bf16; do
                timeout 150 python3 bench/probes/call_timeline.py --adapter nvidia --batches 1 --shape 32,8,128 \
                  --context 4096 --layers 30 --calls 300 --dtype $dt --json-out "$OUT/timeline_1_$dt.json" 2>&1 | tail -2
                timeout 150 python3 bench/probes/call_timeline.py --adapter nvidia --forms stacked --batches 32 \
                  --shape 32,8,128 --context 4096 --layers 4 --calls 300 --dtype $dt \
                  --json-out "$OUT/timeline_32_$dt.json" 2>&1 | tail -1
              done
              timeout 200 python3 bench/probes/call_timeline.py --adapter nvidia --forms stacked --batches 32 \
                --shape 9,3,64 --context 1024 --layers 30 --calls 300 --json-out "$OUT/timeline_smollm2.json" 2>&1 | tail -1 ;;
    build) python3 setup.py -q build_ext --inplace 2>&1 | tail -5; ls service/attnserve/gpu/_commands*.so ;;
    abservice) for round in 1 2; do
                 for tree in "${OLD_TREE:?}" .; do
                   (cd "$tree" && PYTHONPATH="$PWD/service:$PWD/client:$PWD:$PYTHONPATH" timeout 200 python3 \
                      bench/service.py --adapter nvidia --context 4096 --steps 200 --sessions 32 --formats f32 \
                      --skip-threads --transports frames --forms stacked --dtypes f32,bf16 --seconds 4 --pipeline 1 \
                      --json-out "$OUT/service_${round}_$(basename "$(realpath "$tree")").json" 2>&1 | grep -v Warning \
                      | tail -8)
                 done
               done ;;
    abworker) for tree in "${OLD_TREE:?}" .; do
                for n in 1 32; do
                  (cd "$tree" && PYTHONPATH="$PWD/service:$PWD/client:$PWD:$PYTHONPATH" timeout 150 python3 \
                     bench/worker_profile.py --adapter nvidia --sessions $n --context 4096 --stacked --layers 2 \
                     --steps 300 --formats f32 --top 0 2>&1 | tail -1)
                done
              done ;;
    ab) timeout 280 python3 bench/probes/ab_single.py --adapter nvidia --rounds 2 --steps 300 "${OLD_TREE:?}" . 2>&1 \
          | tail -12 | tee "$OUT/ab_single.txt" ;;
  esac
done
