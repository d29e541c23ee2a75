"""GPU machine: SGLang HiCache with pdsdk storage against SGLang's own `file` storage, on the agent load.

The same Qwen3-8B-shaped model (dummy weights) and the same agent load as store_sitting.py. The GPU KV pool
(64000 tokens, pages of 64) and HiCache's host pool (8 GB) are both smaller than the sessions, so the L3
storage serves what the host pool dropped.
Usage: python3 hicache_sitting.py OUT_DIR MODEL_DIR CONFIG...   CONFIG: sglang-none (radix cache only),
sglang-hicache (host pool, no storage), sglang-file, sglang-pdsdk-memory, sglang-pdsdk-disk.
CAPACITY (bytes, default 60e9) sizes the pdsdk stores.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from store_sitting import AGENT, CAPACITY, Engine, bench, line

ENGINE = ["--load-format", "dummy", "--context-length", "16384", "--mem-fraction-static", "0.8",
          "--max-total-tokens", "64000", "--page-size", "64", "--served-model-name", "m"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-size", "8", "--hicache-mem-layout", "page_first",
           "--hicache-write-policy", "write_through"]


def pdsdk_storage(store: dict) -> list[str]:
    extra = {"backend_name": "pdsdk", "module_path": "pdsdk.adapters.sglang.hicache",
             "class_name": "PdsdkHiCacheStorage", "store": store, "interface_v1": 1}
    return ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]


def config(name: str, tmp: Path) -> tuple[list[str], dict]:
    """The server's extra arguments and environment of one configuration."""
    return {
        "sglang-none": ([], {}),
        "sglang-hicache": (HICACHE, {}),
        "sglang-file": ([*HICACHE, "--hicache-storage-backend", "file"],
                        {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp / "file")}),
        "sglang-pdsdk-memory": ([*HICACHE, *pdsdk_storage({"name": "memory", "options": {"capacity_bytes": CAPACITY}})],
                                {}),
        "sglang-pdsdk-disk": ([*HICACHE, *pdsdk_storage({"name": "disk", "options": {
            "path": str(tmp / "pages"), "capacity_bytes": CAPACITY}})], {}),
    }[name]


def main(out: Path, model: str, names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = Path(f"/tmp/sitting-{name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            args, env = config(name, tmp)
            engine = Engine(out, name, [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                                        *ENGINE, *args], {"HF_HUB_OFFLINE": "1", **env})
        except Exception as e:  # noqa: BLE001 - report and go on with the next configuration
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        try:
            started = engine.ready()
            print(f"{name}: start {started:.0f}s | agent {line(bench(engine.port, AGENT, out / f'{name}.json', name))}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
        finally:
            engine.stop()
            shutil.rmtree(tmp, ignore_errors=True)  # the file backend's pages: the disk is 64 GiB
            os.sync()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
