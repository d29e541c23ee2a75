"""The cell grid of `pdsdk matrix`: engine x topology x transport x store (x TP, x variant), names and
the reasons a cell cannot run on this machine (decided before anything starts).

A cell's `id` is stable across runs and machines ("vllm/1P1D/nixl/memory", "vllm/single/-/none/tp2",
"vllm/single/-/none+fp8-kv"): reports merge results files by tier and id.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

from pdsdk.errors import ConfigError

ENGINES = ("vllm", "sglang")
STORES = ("none", "memory", "disk", "redis", "mooncake")

# Variants: extra engine flags for one ablation of the seed's Results 5, and whether greedy outputs
# must still equal the baseline (FP8 KV changes the numbers on purpose).
VARIANTS: dict[str, dict[str, Any]] = {
    "": {"vllm": [], "sglang": [], "exact": True},
    "chunked-off": {"vllm": ["--no-enable-chunked-prefill"], "sglang": ["--chunked-prefill-size", "-1"],
                    "exact": True},
    "fp8-kv": {"vllm": ["--kv-cache-dtype", "fp8_e5m2"], "sglang": ["--kv-cache-dtype", "fp8_e5m2"],
               "exact": False},
}


@dataclass
class Phase:
    """One measured load against a running cell."""
    label: str  # "load", "low", "high", "cold", "warm", "flush"
    num_prompts: int
    isl: int
    osl: int
    rate: float
    concurrency: int = 0
    seed: int = 0
    flush_before: bool = False  # POST /reset_prefix_cache on every worker first


@dataclass
class Cell:
    engine: str
    prefill: int  # 0: a single plain worker (no PD)
    decode: int
    transport: str | None
    store: str = "none"
    tp: int = 1
    variant: str = ""
    group: str = "grid"  # grid | seed (the seed article's layouts) | faults
    scenario: str = ""  # "prefix-cache": cold / warm / flush phases
    phases: list[Phase] = field(default_factory=list)
    skip: str = ""  # why it cannot run here (set by `plan_cells`)

    @property
    def topology(self) -> str:
        return "single" if self.prefill == 0 else f"{self.prefill}P{self.decode}D"

    @property
    def id(self) -> str:
        out = f"{self.engine}/{self.topology}/{self.transport or '-'}/{self.store}"
        if self.tp > 1:
            out += f"/tp{self.tp}"
        out += f"+{self.variant}" if self.variant else ""
        return out + (f"@{self.scenario}" if self.scenario else "")

    @property
    def key(self) -> str:
        """Unique within a tier: the same layout may run in the grid and in the seed tables."""
        return self.id if self.group == "grid" else f"{self.group}:{self.id}"

    @property
    def exact(self) -> bool:
        """Must greedy outputs equal the single-engine baseline token for token?"""
        return VARIANTS[self.variant]["exact"] and self.tp == 1

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def engine_args(self) -> list[str]:
        return list(VARIANTS[self.variant][self.engine])

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(id=self.id, key=self.key, topology=self.topology, exact=self.exact)
        return d


def split(value: str | None, option: str, valid: tuple[str, ...] | None = None) -> list[str]:
    items = [v.strip() for v in (value or "").split(",") if v.strip()]
    if not items:
        raise ConfigError(option, "give at least one value (comma-separated)")
    if valid:
        bad = [v for v in items if v not in valid]
        if bad:
            raise ConfigError(option, f"unknown {', '.join(bad)}; valid: {', '.join(valid)}")
    return items


def parse_topology(text: str) -> tuple[int, int]:
    """'single' -> (0, 1); '1P1D' / '2p1d' -> (1, 1) / (2, 1)."""
    if text.lower() == "single":
        return 0, 1
    m = re.fullmatch(r"(\d+)[pP](\d+)[dD]", text)
    if not m or int(m.group(2)) < 1 or int(m.group(1)) < 1:
        raise ConfigError("--topologies", f"{text!r} is not 'single' or xPyD such as 1P1D, 2P1D (x, y >= 1)")
    return int(m.group(1)), int(m.group(2))


def grid(engines: list[str], topologies: list[str], transports: list[str], stores: list[str],
         tps: list[int]) -> list[Cell]:
    """Every combination; a single worker has no transport, so it varies over stores only."""
    cells: list[Cell] = []
    seen: set[str] = set()
    for engine in engines:
        for topo in topologies:
            p, d = parse_topology(topo)
            for tp in tps:
                for transport in ([None] if p == 0 else transports):
                    for store in stores:
                        cell = Cell(engine, p, d, transport, store, tp)
                        if cell.id not in seen:
                            seen.add(cell.id)
                            cells.append(cell)
    return cells


def seed_cells(engine: str, transport: str, low: Phase, high: Phase, prefix: Phase) -> list[Cell]:
    """The seed article's layouts (Results 1-3 and 5; Results 4 is Results 1-2 with a 32B --model):
    single vs TP=2 vs PD 1P1D at low and high load, the prefix cache cold / warm / after a flush,
    chunked prefill off and FP8 KV against the single engine. Cells with the same launch share one start
    (the runner groups them), so the cold phase starts from a flushed cache too."""
    two = [low, high]
    cache = [Phase("cold", **_same(prefix), flush_before=True), Phase("warm", **_same(prefix)),
             Phase("flush", **_same(prefix), flush_before=True)]
    return [Cell(engine, 0, 1, None, phases=two, group="seed"),
            Cell(engine, 0, 1, None, tp=2, phases=two, group="seed"),
            Cell(engine, 1, 1, transport, phases=two, group="seed"),
            Cell(engine, 0, 1, None, phases=cache, group="seed", scenario="prefix-cache"),
            Cell(engine, 0, 1, None, variant="chunked-off", phases=[low], group="seed"),
            Cell(engine, 0, 1, None, variant="fp8-kv", phases=[low], group="seed")]


def _same(p: Phase) -> dict[str, Any]:
    return {"num_prompts": p.num_prompts, "isl": p.isl, "osl": p.osl, "rate": p.rate,
            "concurrency": p.concurrency, "seed": p.seed}


def why_not(cell: Cell, gpus: list[int] | None) -> str:
    """Empty when the cell can run here; else the reason and what would make it run."""
    if cell.engine == "sglang" and not gpus:
        return "SGLang cannot serve on CPU (no CPU kernels); run this cell on GPUs with --gpus"
    if cell.tp > 1 and not gpus:
        return f"TP={cell.tp} needs GPUs (--gpus with {cell.workers * cell.tp} ids); vLLM TP on 2 shared CPU cores is not run"
    if gpus and len(gpus) < cell.workers * cell.tp:
        return f"needs {cell.workers * cell.tp} GPUs ({cell.workers} workers x TP {cell.tp}); --gpus gave {len(gpus)}"
    if cell.engine == "sglang" and cell.prefill == 0 and cell.store != "none":
        return ("`pdsdk launch` does not give plain SGLang workers a HiCache store yet; SGLang's stores run "
                "in its PD cells")
    from pdsdk.plugins import registry

    if cell.transport:
        try:
            spec = registry().get("transport", cell.transport)
        except Exception as e:  # noqa: BLE001 - unknown names are reported per cell
            return f"transport {cell.transport!r}: {e}"
        if spec.why_not:
            return f"transport {cell.transport}: {spec.why_not}"
    if cell.store != "none":
        try:
            spec = registry().get("store", cell.store)
        except Exception as e:  # noqa: BLE001
            return f"store {cell.store!r}: {e}"
        if spec.why_not:
            return f"store {cell.store}: {spec.why_not}"
        if cell.store == "redis" and shutil.which("redis-server") is None:
            return "store redis needs a redis-server here (apt install redis-server)"
    return ""
