#!/usr/bin/env bash
# GPU machine (nvidia-h200-x2, or nvidia-h200 with both peers on GPU 0): the GPU tier in steps, so one
# call can run several and the next call the rest.
#   bash tests/gpu/tier.sh setup transports serve single tp2 ...
# setup: install the staged wheels ($HOME/stage, see tests/gpu/README.md) and pdsdk from the carried
#   archive .whl/pdsdk.tar (`git archive HEAD`, so other engineers' uncommitted edits never travel), and
#   write the Qwen3-8B-shaped model to $HOME/qwen3-8b-shape.
# transports: `pdsdk bench transport` GPU0 <- GPU1 for every transport, Mooncake's NVLink protocol, the
#   staged path on/off, and the NCCL send/recv ceiling.
# local: the `local` transport alone: the Triton page kernel beside torch's, and where its time goes.
# nixl-delay: NIXL's paged case with its progress thread busy (0) and sleeping (1000 us, the default).
# invariance: tests/gpu/invariance.py (vLLM's batch-invariant mode against the exact greedy check).
# kv-events ENGINE: tests/gpu/kv_events_real.py (the kv_events policy over two real workers of ENGINE).
# matrix ARGS...: `pdsdk matrix` on the GPUs (its GPU tier), the rest of the arguments passed on.
# store-path: `pdsdk bench store-path` on GPU 0 for the memory and tiered stores (bytes verified).
# store CONFIG...: tests/gpu/store_sitting.py (vLLM with no store, OffloadingConnector, pdsdk stores, two
#   engines sharing redis (carry .whl/redis); agent load).
# routers: `pdsdk bench router --peer vllm-router,sglang-router` on the machine's cores (no GPU), pdsdk's
#   router with 8, 12 and 16 processes (ROUTER_PROCESSES), 3 rounds (ROUTER_ROUNDS); carry .whl/rbench (the
#   routers' wheels and their fastapi/uvicorn, msgspec, pyzmq, uvloop, psutil, and Debian's wrk + libluajit .debs:
#   see tests/gpu/README.md). Needs no setup step.
# hicache CONFIG...: tests/gpu/hicache_sitting.py (SGLang HiCache: its `file` storage against pdsdk stores).
# serve CONFIG...: tests/gpu/serve_tier.py (vLLM or SGLang configurations) with the rest of the call's time (10 minutes a call).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PIP_BREAK_SYSTEM_PACKAGES=1 NIXL_LOG_LEVEL=WARN MC_LOG_LEVEL=WARNING GLOG_minloglevel=2 \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SRC=$HOME/pdsdk-src; MODEL=$HOME/qwen3-8b-shape; LIMIT=${LIMIT:-585}
# One GPU (the nvidia-h200 kind): peers share GPU 0, serve_tier.py splits its memory between workers.
export PDSDK_GPU_COUNT=${PDSDK_GPU_COUNT:-$(nvidia-smi -L | wc -l)}
PEER=cuda:$((PDSDK_GPU_COUNT > 1 ? 1 : 0))
# redis-server for the chaos run's store, carried from a Debian machine with its two libraries the GPU
# machine lacks (.whl/redis: redis-server, liblzf.so.1, libjemalloc.so.2, the redis and xxhash wheels).
export PATH=$HOME/redis:$PATH LD_LIBRARY_PATH=$HOME/redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
step_setup() {
  [ -d "$HOME/wheels" ] || { bash "$HOME"/stage/part*/install.sh > "$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"; }
  [ -d .whl/redis ] && mkdir -p "$HOME/redis" && cp .whl/redis/* "$HOME/redis/" \
    && python3 -m pip install -q --no-deps "$HOME"/redis/*.whl > "$OUT/redis-install.log" 2>&1
  rm -rf "$SRC" && mkdir -p "$SRC" && tar -xf .whl/pdsdk.tar -C "$SRC"
  (cd "$SRC" && python3 -m pip install -q --no-deps --no-build-isolation . > "$OUT/pdsdk-install.log" 2>&1) \
    || tail -5 "$OUT/pdsdk-install.log"
  (cd /tmp && python3 -c "
import importlib.metadata as m
for p in ('vllm', 'sglang', 'nixl', 'mooncake-transfer-engine-cuda13', 'pdsdk', 'torch', 'transformers', 'redis'):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: pass")
  [ -n "${NO_WEIGHTS:-}" ] || (cd /tmp && python3 "$SRC/tests/gpu/qwen3_model.py" "$MODEL")
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
  (cd /tmp && python3 -m pdsdk doctor --json > "$OUT/doctor.json" 2>&1)
}
bench() { # name, extra args
  local name=$1; shift
  (cd /tmp && timeout 240 python3 -m pdsdk bench transport --device cuda:0 --peer-device $PEER --page-bytes 32768 \
    --timeout 120 --doc "" --json "$OUT/bench-$name.json" "$@" > "$OUT/bench-$name.txt" 2>&1)
  python3 - "$OUT/bench-$name.json" <<'PY'
import json, sys
try:
    records = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"{sys.argv[1]}: {e}")
for r in records:
    if "gbps" in r:
        print(f"{r['transport']:9} {r['case']:10} {r['bytes'] >> 20:5} MiB {r['seconds'] * 1e3:9.3f} ms "
              f"{r['gbps']:8.2f} GB/s x{r.get('ratio_to_ceiling')} {r.get('ratio_to_contiguous') or ''} "
              f"verified={r['verified']} {r['path'][:60]}")
    else:
        print(r["transport"], "ERROR", r.get("error", "")[:300])
PY
}
step_transports() {
  echo "== all transports"; bench all --sizes 1,16,151,1024 --pages 4608 --repeats 10
  echo "== mooncake nvlink_intra"; bench mooncake-nvlink --transports mooncake --sizes 151,1024 --repeats 5 \
    --option mooncake.protocol=nvlink_intra
  for s in off on; do echo "== staging $s"; bench "staging-$s" --transports nixl,mooncake --sizes 151 --repeats 5 --staging $s; done
  step_local
  [ "$PDSDK_GPU_COUNT" -gt 1 ] && (cd /tmp && timeout 120 python3 "$SRC/tests/gpu/nccl_ceiling.py")
}
step_local() {
  for k in torch triton; do echo "== local, $k page kernel"; bench "local-$k" --transports local --sizes 1,151 \
    --pages 4608 --repeats 10 --option local.gpu_kernel=$k; done
  for k in torch triton; do echo "== profile local ($k)"; (cd /tmp && PEER=$PEER KERNEL=$k timeout 120 \
    python3 "$SRC/tests/gpu/profile_local.py" 2>&1 | grep -v "^\s*$" | head -30 > "$OUT/profile-$k.txt"; head -3 "$OUT/profile-$k.txt"); done
}
step_nixl_delay() {
  for d in 0 1000; do echo "== nixl, progress_delay_us=$d"; bench "nixl-delay-$d" --transports nixl --sizes 1,151 \
    --pages 4608 --repeats 10 --option nixl.progress_delay_us=$d; done
}
step_matrix() {
  local name=matrix-$(date +%H%M%S)
  (cd /tmp && timeout $((LIMIT - SECONDS)) python3 -m pdsdk matrix --model "$MODEL" --tier "gpu-h200x$PDSDK_GPU_COUNT" --quiet \
    --engine-args "--max-model-len 4096" --out "$OUT/$name" "$@") > "$OUT/$name.log" 2>&1
  cp "$OUT/$name/results.json" "$OUT/$name-results.json"; tail -25 "$OUT/$name.log"
}
while [ $# -gt 0 ]; do
  case $1 in
    setup) step_setup; shift ;;
    transports) step_transports; shift ;;
    local) step_local; shift ;;
    nixl-delay) step_nixl_delay; shift ;;
    kv-events) (cd /tmp && timeout $((LIMIT - SECONDS)) python3 "$SRC/tests/gpu/kv_events_real.py" "$2" "$MODEL") \
      > "$OUT/kv-events-$2.log" 2>&1; grep "^kv-events" "$OUT/kv-events-$2.log" || tail -5 "$OUT/kv-events-$2.log"; shift 2 ;;
    invariance) (cd /tmp && timeout $((LIMIT - SECONDS)) python3 "$SRC/tests/gpu/invariance.py" "$MODEL") \
      > "$OUT/invariance.log" 2>&1; tail -6 "$OUT/invariance.log"; shift ;;
    matrix) shift; step_matrix "$@"; break ;;
    store-path) for store in memory '{"tiered":["memory",{"name":"disk","options":{"path":"/tmp/sp-disk"}}]}'; do
        (cd /tmp && timeout 200 python3 -m pdsdk bench store-path --device cuda:0 --store "$store" --repeats 5 \
          --json "$OUT/store-path-$(echo "$store" | head -c 6 | tr -dc a-z).json" 2>&1 | tail -9); done; shift ;;
    store) shift; (cd /tmp && python3 "$SRC/tests/gpu/qwen3_model.py" "$HOME/qwen3-8b-config" --config-only \
      && timeout $((LIMIT - SECONDS)) python3 "$SRC/tests/gpu/store_sitting.py" "$OUT" "$HOME/qwen3-8b-config" "$@") \
      > "$OUT/store.log" 2>&1; grep -E "^(none|vllm-|pdsdk-|shared-)" "$OUT/store.log" || tail -20 "$OUT/store.log"; break ;;
    routers) python3 -m pip install -q --no-deps --no-build-isolation .whl/rbench/*.whl . > "$OUT/rbench-install.log" 2>&1 \
        || tail -5 "$OUT/rbench-install.log"
      for f in .whl/rbench/*.deb; do dpkg -x "$f" "$HOME/wrk"; done
      (cd /tmp && PATH=$HOME/wrk/usr/bin:$PATH LD_LIBRARY_PATH=$HOME/wrk/usr/lib/x86_64-linux-gnu \
        timeout $((LIMIT - SECONDS)) python3 -m pdsdk bench router --peer vllm-router,sglang-router --streams 64,512 \
        --workers 4 --processes ${ROUTER_PROCESSES:-8,12,16} --rounds ${ROUTER_ROUNDS:-3} \
        --json "$OUT/router-16core.json" 2>&1 | tail -24); shift ;;
    hicache) shift; (cd /tmp && python3 "$SRC/tests/gpu/qwen3_model.py" "$HOME/qwen3-8b-config" --config-only \
      && timeout $((LIMIT - SECONDS)) python3 "$SRC/tests/gpu/hicache_sitting.py" "$OUT" "$HOME/qwen3-8b-config" "$@") \
      > "$OUT/hicache.log" 2>&1; grep -E "^sglang-" "$OUT/hicache.log" || tail -20 "$OUT/hicache.log"; break ;;
    serve|vllm|sglang) shift; (cd /tmp && PDSDK_GPU_BUDGET=$((LIMIT - SECONDS)) python3 "$SRC/tests/gpu/serve_tier.py" "$MODEL" "$@") \
      > "$OUT/vllm.log" 2>&1; grep -E "^(single|tp2|pd-|sglang|skipped)" "$OUT/vllm.log"; break ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
# The device returns at most 8 files: JSON results as they are, everything else in one archive.
(cd "$OUT" && others=$(ls -A | grep -v '\.json$') && [ -n "$others" ] && tar -czf rest.tgz $others && rm -rf $others)
echo "call took ${SECONDS}s"
