"""Reading `pdsdk matrix` results files and merging them: by tier, then by cell key (a later file's
cell replaces an earlier one of the same tier and key), so a GPU run's rows join the CPU ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdsdk.errors import ConfigError
from pdsdk.matrix.runner import KIND


def load_results(path: str | Path) -> dict[str, Any]:
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(str(path), f"cannot read a matrix result ({e})") from None
    if not isinstance(rec, dict) or rec.get("kind") != KIND:
        raise ConfigError(str(path), "is not a `pdsdk matrix` results.json")
    return rec


def by_tier(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{tier: merged record}: cells merged by key, each cell keeping its own run's versions and date."""
    tiers: dict[str, dict[str, Any]] = {}
    for rec in records:
        tier = tiers.setdefault(rec["tier"], {"tier": rec["tier"], "runs": [], "cells": {}, "faults": None})
        run = {k: rec.get(k) for k in ("date", "machine", "pdsdk", "model", "versions", "duration_s", "options")}
        tier["runs"].append(run)
        for cell in rec.get("cells", []):
            tier["cells"][cell.get("key", cell["id"])] = {**cell, "run": run}
        if rec.get("faults"):
            tier["faults"] = {**rec["faults"], "run": run}
    for tier in tiers.values():
        tier["cells"] = list(tier["cells"].values())
    return tiers
