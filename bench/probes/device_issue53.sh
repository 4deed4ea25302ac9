#!/usr/bin/env bash
# Device calls for issues 53 and 54 (docs/benchmarks.md): the layer call by how it
# travels, the GPU thread's floor (a tiny submission + readback), the server's CPU
# per call and per item by thread; the half-precision decode kernels beside torch;
# generate() beside sdpa. Run from the repository root on the device machine after
# its prefix (the wheels, the Vulkan loader, the C modules built in place); results
# go to $OUT (default bench/results), named by $STAMP (default: the commit).
#
#   PART=quick bash bench/probes/device_issue53.sh     # decode kernels, layer call, floor (one call, ~8 min)
#   PART=call bash bench/probes/device_issue53.sh      # the layer call, the floor and the server's CPU
#   PART=decode bash bench/probes/device_issue53.sh    # the half-precision decode kernels
#   PART=generate bash bench/probes/device_issue53.sh  # generate() beside sdpa (transformers >= 5.25 in the path)
set -uo pipefail
OUT="${OUT:-bench/results}"
stamp="${STAMP:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PART="${PART:-quick}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
want() { case " $* " in *" $PART "*) return 0;; esac; return 1; }
if want decode quick; then
  timeout 300 python3 bench/probes/half_decode_variants.py --adapter nvidia --budget 0.05 \
    --json-out "$OUT/half-decode-variants-$stamp.json" || echo "half_decode_variants: exit $?"
fi
if want call quick; then
  timeout 40 python3 bench/probes/submit_floor.py --adapter nvidia --calls 2000 \
    --json-out "$OUT/submit-floor-$stamp.json" || echo "submit_floor: exit $?"
  timeout 150 python3 bench/probes/layer_call.py --adapter nvidia --seconds 1.5 \
    --json-out "$OUT/layer-call-$stamp.json" || echo "layer_call: exit $?"
fi
if want call; then
  timeout 200 python3 bench/server_cpu.py --adapter nvidia --steps --items 1,16,64,256 --calls 400 --repeats 3 \
    --json-out "$OUT/server-cpu-steps-gpu-$stamp.json" || echo "server_cpu --steps: exit $?"
fi
if want generate; then
  timeout 540 python3 bench/generate.py --adapter nvidia --random smollm2-135m --batches 32,1 --prompt 256 \
    --new 64 --settings f32 --transport frames --out "$OUT/generate-smollm2-random-f32-$stamp.json" \
    || echo "generate: exit $?"
fi
