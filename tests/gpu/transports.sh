#!/usr/bin/env bash
# GPU machine: transports between two processes, VRAM to VRAM, beside the ceiling, bytes verified.
# Usage (on the device, after the wheel parts are in $HOME/stage): bash tests/gpu/transports.sh
# With two GPUs the peer is on cuda:1; with one, both processes share cuda:0.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PIP_BREAK_SYSTEM_PACKAGES=1 NIXL_LOG_LEVEL=WARNING MC_LOG_LEVEL=WARNING GLOG_minloglevel=2
[ -d "$HOME/wheels" ] || bash "$HOME"/stage/part*/install.sh > "$OUT/install.log" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation . > "$OUT/pdsdk-install.log" 2>&1 || tail "$OUT/pdsdk-install.log"
cd /tmp
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -m pdsdk doctor --json > "$OUT/doctor.json" 2>&1
python3 -m pdsdk plugins --json > "$OUT/plugins.json" 2>&1
GPUS=$(nvidia-smi -L | wc -l)
PEER=cuda:$((GPUS > 1 ? 1 : 0))
for staging in auto off on; do
  python3 -m pdsdk bench transport --device cuda:0 --peer-device "$PEER" --sizes 1,16,151,1024 --pages 4608 \
    --page-bytes 32768 --repeats 10 --staging $staging --timeout 120 --doc "" \
    --json "$OUT/bench-transport-$staging.json" > "$OUT/bench-transport-$staging.txt" 2>&1
  grep -E "│|┃" "$OUT/bench-transport-$staging.txt" | head -40
done
