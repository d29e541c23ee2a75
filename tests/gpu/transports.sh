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
GPUS=$(nvidia-smi -L | wc -l)
PEER=cuda:$((GPUS > 1 ? 1 : 0))
bench() { # name, extra args
  local name=$1; shift
  python3 -m pdsdk bench transport --device cuda:0 --peer-device "$PEER" --page-bytes 32768 --timeout 120 \
    --doc "" --json "$OUT/bench-$name.json" "$@" > "$OUT/bench-$name.txt" 2>&1
  python3 - "$OUT/bench-$name.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "gbps" in r:
        print(f"{r['transport']:9} {r['case']:10} {r['bytes'] >> 20:5} MiB {r['seconds'] * 1e3:9.3f} ms "
              f"{r['gbps']:8.2f} GB/s x{r.get('ratio_to_ceiling')} {r.get('ratio_to_contiguous') or ''} "
              f"verified={r['verified']} {r['path'][:60]}")
    else:
        print(r["transport"], "ERROR", r.get("error", "")[:300])
PY
}
echo "== all transports"; bench all --sizes 1,16,151,1024 --pages 4608 --repeats 10
for s in off on; do echo "== staging $s"; bench "staging-$s" --transports nixl,mooncake --sizes 151 --repeats 5 --staging $s; done
python3 -m pdsdk -v bench transport --transports mooncake --device cuda:0 --peer-device "$PEER" --sizes 1 --pages 0 \
  --repeats 1 --doc "" > "$OUT/mooncake-debug.txt" 2>&1; grep -B2 -A25 Traceback "$OUT/mooncake-debug.txt" | tail -40
