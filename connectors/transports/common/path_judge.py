"""Whether GPU memory really moved GPU to GPU: a transport's bytes can silently take a host (TCP)
path instead of NVLink/PCIe P2P, and only their rate tells.

Judged only on large transfers of few runs (thousands of scattered pages are slow for other
reasons), by the fastest of a peer's first JUDGED_TRANSFERS after its first (which pays for mapping
and connection setup: measured 6 GB/s for a first CUDA IPC transfer that then ran at 240). The
fastest, because a busy GPU or a queue slows some transfers of a P2P path (single ones to 3.7-9 GB/s
under load on 2xH200) but a host path never runs one fast.
"""

from __future__ import annotations

MIN_VRAM_GBPS = 20.0  # below this, a large VRAM->VRAM transfer did not take NVLink/PCIe P2P
JUDGED_TRANSFERS = 3  # large VRAM transfers per peer (after the first) whose fastest judges the path


class PathJudge:
    def __init__(self) -> None:
        self._rates: dict[str, list[float]] = {}  # peer -> GB/s of its large VRAM transfers until judged

    def host_path_rate(self, peer: str, nbytes: int, spans: int, seconds: float) -> float | None:
        """The best rate seen, once a peer's transfers show a host path; None otherwise."""
        if nbytes < (16 << 20) or spans > 64:
            return None
        rates = self._rates.setdefault(peer, [])
        if len(rates) > JUDGED_TRANSFERS:
            return None  # judged already
        rates.append(nbytes / seconds / 1e9)
        if len(rates) <= JUDGED_TRANSFERS:
            return None
        best = max(rates[1:])
        return best if best < MIN_VRAM_GBPS else None
