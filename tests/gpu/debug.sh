export PIP_BREAK_SYSTEM_PACKAGES=1 GLOG_minloglevel=2
python3 -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
cd /tmp
python3 -m pdsdk bench transport --transports local --device cuda:0 --peer-device cuda:0 --sizes 1,151,1024 --repeats 10 --doc "" --json $OUT/local.json 2>&1 | grep -E "│|rror" | cut -c1-140
python3 - <<'PY' 2>&1 | grep -v "^[IW]1129" | tail -30
import traceback, torch
from pdsdk.connectors.transports.common.buffers import allocate
from pdsdk.kv import KVLayout
from pdsdk.plugins import registry
try:
    t = registry().load("transport","mooncake")(name="mooncake", layout=KVLayout(num_layers=1,num_kv_heads=8,head_dim=64,page_size=32,device="cuda:0"))
    print("created")
    buf, reg = allocate(64<<20, "cuda:0"); print("allocated")
    t.register([reg]); print("registered")
    print(t.descriptor()[:10])
except Exception:
    traceback.print_exc()
PY
