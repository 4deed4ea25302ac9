#!/usr/bin/env bash
# One device call's measurements for issue 53's first slice and issue 54's first
# probe (docs/benchmarks.md): the layer call by how it travels, the server's CPU
# per call and per item by thread, then the half-precision decode kernels beside torch. Run from the repository root on the
# device machine after its prefix (the wheels, the Vulkan loader, the C modules
# built in place); results go to $OUT (default bench/results).
#
#   bash bench/probes/device_issue53.sh              # everything (over one call's 600 s)
#   PART=call bash bench/probes/device_issue53.sh    # the layer call and the server's CPU
#   PART=decode bash bench/probes/device_issue53.sh  # the half-precision decode kernels
set -uo pipefail
OUT="${OUT:-bench/results}"
stamp="${STAMP:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PART="${PART:-all}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
[ "$PART" = decode ] || timeout 230 python3 bench/probes/layer_call.py --adapter nvidia --seconds 2 \
  --json-out "$OUT/layer-call-$stamp.json" || echo "layer_call: exit $?"
[ "$PART" = decode ] || timeout 200 python3 bench/server_cpu.py --adapter nvidia --steps --items 1,16,64,256 --calls 400 --repeats 3 \
  --json-out "$OUT/server-cpu-steps-gpu-$stamp.json" || echo "server_cpu --steps: exit $?"
[ "$PART" = call ] || timeout 400 python3 bench/probes/half_decode_variants.py --adapter nvidia \
  --json-out "$OUT/half-decode-variants-$stamp.json" || echo "half_decode_variants: exit $?"
