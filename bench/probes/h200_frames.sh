#!/usr/bin/env bash
# The frame transport against the WebSocket stream on the lent H200, in one device
# call (every figure of the comparison from the same call):
#   bash bench/probes/h200_frames.sh OUT_DIR [FORMATS]
# 1. bench/step_profile.py over the stream, then over the frames (16, 64, 256
#    sessions x 4k, one stacked step in flight: event loop / GPU thread CPU per item);
# 2. bench/service.py, stacked steps of 64 x 4k over HTTP, the stream and the frames,
#    one and 4 in flight, and single fused steps;
# 3. bench/service.py, stacked steps of 256 x 4k over the stream and the frames.
set -u
OUTDIR=${1:?out dir}
FORMATS=${2:-f32}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PYTHONPATH:$(pwd)"
for transport in stream frames; do
  echo "== step_profile $transport"
  timeout 150 python3 bench/step_profile.py --adapter nvidia --formats "$FORMATS" --batches 16,64,256 \
    --context 4096 --steps 20 --transport "$transport" --json-out "$OUTDIR/profile-$transport.json" | tail -n 4
done
echo "== service 64"
timeout 260 python3 bench/service.py --adapter nvidia --skip-threads --forms stacked --seconds 4 --steps 150 \
  --formats "$FORMATS" --sessions 64 --json-out "$OUTDIR/service-64.json" | grep -v '^#'
echo "== service 256"
timeout 150 python3 bench/service.py --adapter nvidia --skip-threads --skip-single --forms stacked --seconds 4 \
  --formats "$FORMATS" --sessions 256 --pipeline 1 --transports stream,frames \
  --json-out "$OUTDIR/service-256.json" | grep -v '^#'
