"""Shared by every `pdsdk bench ...`: machine description, JSON output, rows in docs/benchmarks.md."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> str:
    """One line naming the machine the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores {cpu}, {mem:.0f} GiB"


def write_json(path: str | None, records: list[dict[str, Any]]) -> None:
    if path:
        Path(path).write_text(json.dumps(records, indent=2) + "\n")


def append_rows(doc: str | Path, section: str, rows: list[list[Any]]) -> Path:
    """Append rows to the first table under `## {section}` of a markdown file (the table must exist)."""
    doc = Path(doc)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == f"## {section}")
    except StopIteration:
        raise ValueError(f"{doc} has no section '## {section}'; add it with its table header") from None
    # The section's first table: rows go right after its last row (subsections may follow it).
    first = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("|")), None)
    if first is None or any(lines[i].startswith("## ") for i in range(start + 1, first)):
        raise ValueError(f"{doc}: section '## {section}' has no table; add its header row")
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    today = dt.date.today().isoformat()
    new = ["| " + " | ".join(str(c) for c in [today, machine(), *row]) + " |" for row in rows]
    lines[end:end] = new
    doc.write_text("\n".join(lines) + "\n")
    return doc
