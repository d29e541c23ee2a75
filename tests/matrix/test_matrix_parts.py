"""`pdsdk matrix` without an engine: the cell grid, the correctness check, the chaos judge, merging
results files into per-tier doc sections, and the HTML report (rendered by headless Chromium)."""

from __future__ import annotations

import json

import pytest
from matrix.browser import assert_renders, chromium
from matrix.fake_results import VERSIONS, record
from helpers import REQUIRE_ALL, eventually, run_cli

from pdsdk.errors import ConfigError
from pdsdk.matrix import cells as C
from pdsdk.matrix import correctness, report_html, report_md
from pdsdk.matrix.faults import judge
from pdsdk.matrix.loadgen import Result
from pdsdk.matrix.results import by_tier


def test_grid_names_and_skips():
    cells = C.grid(["vllm"], ["single", "1P1D", "2p1d"], ["nixl", "local"], ["none", "memory"], [1, 2])
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids))
    assert "vllm/single/-/none" in ids and "vllm/1P1D/nixl/memory" in ids and "vllm/2P1D/local/none/tp2" in ids
    assert sum(c.prefill == 0 for c in cells) == 4  # single: stores x TP only, no transport
    tp2 = next(c for c in cells if c.tp == 2 and c.prefill == 2)
    assert "GPUs" in C.why_not(tp2, None) and C.why_not(tp2, [0, 1, 2, 3, 4, 5]) == ""
    assert "--gpus gave 2" in C.why_not(tp2, [0, 1])
    assert C.why_not(next(c for c in cells if c.prefill == 0 and c.store == "memory"), None) == ""  # store-only worker
    assert "SGLang" in C.why_not(C.Cell("sglang", 1, 1, "nixl"), None)
    assert "unknown" in C.why_not(C.Cell("vllm", 1, 1, "carrier-pigeon"), None).lower()


@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_a_server_store_starts_in_a_cell_folder_that_does_not_exist_yet(tmp_path, store):
    """The cell's log folder is created by the launch that comes after the store's server."""
    from pdsdk.plugins import registry
    from pdsdk.matrix.runner import store_spec

    if registry().get("store", store).why_not:
        (pytest.fail if REQUIRE_ALL else pytest.skip)(registry().get("store", store).why_not)
    spec, servers = store_spec(store, tmp_path / "logs" / "cell")
    try:
        assert spec["name"] == store and len(servers) == 1
        assert (tmp_path / "logs" / "cell").is_dir()
    finally:
        for server in servers:
            server.stop()


def test_bad_options_name_the_option():
    with pytest.raises(ConfigError, match="--topologies"):
        C.parse_topology("1P0D")
    with pytest.raises(ConfigError, match="--stores.*valid"):
        C.split("none,floppy", "--stores", C.STORES)
    done = run_cli("matrix", "--transports", "", "--list")
    assert done.returncode == 2 and "--transports" in done.stderr


def test_gpu_cells_are_held_exact_only_in_batch_invariant_mode(tmp_path):
    from pdsdk.matrix.runner import MatrixOptions

    cpu = MatrixOptions(model="m", out=tmp_path)
    assert cpu.judges_exactly("vllm") and cpu.engine_env("vllm") == {}
    gpu = MatrixOptions(model="m", out=tmp_path, gpus=[0, 1], batch_invariant=True)
    assert gpu.judges_exactly("vllm") and gpu.engine_env("vllm") == {"VLLM_BATCH_INVARIANT": "1"}
    assert not gpu.judges_exactly("sglang") and gpu.engine_env("sglang") == {}  # no such mode wired for SGLang
    speed = MatrixOptions(model="m", out=tmp_path, gpus=[0, 1], batch_invariant=False)
    assert not speed.judges_exactly("vllm") and speed.engine_env("vllm") == {}
    done = run_cli("matrix", "--batch-invariant", "--list")
    assert done.returncode == 2 and "--batch-invariant" in done.stderr and "--gpus" in done.stderr


def test_list_shows_seed_layouts_and_reasons():
    done = run_cli("matrix", "--preset", "ci", "--seed-tables", "--list")
    assert done.returncode == 0, done.stderr
    assert "vllm/1P1D/local/memory" in done.stderr and "seed:vllm/single/-/none/tp2" in done.stderr
    assert "TP=2 needs GPUs" in done.stderr
    only = run_cli("matrix", "--preset", "ci", "--seed-tables", "--only", "seed:*prefix-cache,vllm/1P1D/local/*", "--list")
    assert only.returncode == 0 and only.stderr.count("runs") == 3, only.stderr
    none = run_cli("matrix", "--only", "nothing*", "--list")
    assert none.returncode == 2 and "--only" in none.stderr


def test_compare_finds_the_first_differing_token():
    expected = {0: [1, 2, 3, 4], 1: [5, 6, 7], 2: [9, 9]}
    same = correctness.compare(expected, {0: [1, 2, 3, 4], 1: [5, 6, 7], 2: [9, 9]})
    assert same["ok"] and same["equal"] == 3 and same["by"] == "token_ids"
    diff = correctness.compare(expected, {0: [1, 2, 3, 4], 1: [5, 8, 7], 2: [9, 9]})
    assert not diff["ok"] and diff["equal"] == 2 and diff["mismatches"][0]["index"] == 1
    assert diff["mismatches"][0]["position"] == 1
    missing = correctness.compare(expected, {0: [1, 2, 3, 4]}, errors=["HTTP 502"])
    assert not missing["ok"] and missing["errors"] == ["HTTP 502"]
    assert correctness.compare(expected, {1: [0]}, exact=False)["ok"] is False  # still incomplete
    assert correctness.compare({1: [5]}, {1: [0]}, exact=False)["ok"]  # FP8 KV: differences allowed


def test_chaos_judge_counts_lost_cut_wrong_and_late():
    def res(i, ok=True, ids=(1, 2), e2e=1.0, error="", ttft=0.1):
        return Result(ok, 10, 2, ttft, e2e, index=i, token_ids=list(ids), error=error)

    expected = {i: [1, 2] for i in range(6)}
    out = judge([res(0), res(1, ids=(1, 3)), res(2, e2e=50.0), res(3, ok=False, error="HTTP 503", ttft=0.0),
                 res(4, ids=(1,)), res(5, ok=False, ids=(1,), error="error event: worker failed mid-stream")],
                expected, 30)
    assert (out["completed"], out["lost"], out["cut"], out["wrong"], out["late"]) == (3, 2, 1, 1, 1)
    assert out["wrong_examples"][0]["index"] == 1 and out["wrong_examples"][0]["position"] == 1
    assert out["lost_reasons"] == ["HTTP 503", "stream ended after 1 of 2 tokens without an error event"]
    assert out["cut_reasons"] == ["error event: worker failed mid-stream"]


def test_chaos_faults_one_process_at_a_time_never_the_last_decode_and_waits_for_the_restart(monkeypatch):
    from types import SimpleNamespace

    from pdsdk.matrix import faults

    killed = []
    monkeypatch.setattr(faults.os, "killpg", lambda pid, sig: killed.append(pid))
    children = {name: SimpleNamespace(restarts=0, state="healthy", proc=SimpleNamespace(pid=pid))
                for pid, name in enumerate(["prefill-0", "decode-0", "decode-1", "router"], start=10**7)}
    plan = SimpleNamespace(workers=[SimpleNamespace(name=n, role=n.split("-")[0]) for n in list(children)[:3]],
                           router=SimpleNamespace(name="router"))
    chaos = faults.Chaos(SimpleNamespace(sup=SimpleNamespace(children=children), plan=plan), None,
                         faults.FaultOptions(requests=1, rate=1, deadline_s=1, prefill=1))
    try:
        chaos.kill_decode()
        victim = chaos.faulty
        assert victim in ("decode-0", "decode-1") and killed == [children[victim].proc.pid]
        chaos.kill_router()  # one at a time
        assert killed == [children[victim].proc.pid] and "already down" in chaos.events[-1]["note"]
        children[victim].restarts, children[victim].state = 1, "healthy"  # the Supervisor brought it back
        assert eventually(lambda: chaos.faulty is None, 5)
        assert chaos.events[-1]["kind"] == "restarted" and chaos.events[-1]["target"] == victim
        chaos.roles["decode"] = ["decode-0"]
        chaos.kill_decode()
        assert chaos.faulty is None and "would leave no decode" in chaos.events[-1]["note"]
        chaos.kill_prefill()  # vLLM: the last prefill may go, a decode worker serves alone
        assert chaos.faulty == "prefill-0"
    finally:
        chaos.finish()


def test_markdown_sections_merge_per_tier(tmp_path):
    doc = tmp_path / "matrix.md"
    doc.write_text("# Title\n\nHand-written intro stays.\n")
    report_md.update_doc(doc, [record("cpu")])
    text = doc.read_text()
    assert "Hand-written intro stays." in text and "<!-- pdsdk-matrix:cpu begin -->" in text
    assert "`vllm/1P1D/nixl/none`" in text and "**failed**" in text and "Results 3: prefix cache" in text
    assert "#### Chaos run" in text and "**0 / 0 / 0**" in text and "RuntimeError: boom" in text
    assert "| 40 | 38 | 0 | 2 | 0 | 0 | **0 / 0 / 0** | 3 | 1 |" in text  # cut streams apart from the goal
    assert "| `kill_prefill` | 1 | prefill-1 | 42 |" in text and "| `kill_decode` | 1 | decode-0 | 42 |" in text
    assert "Cut streams: `error event: worker failed mid-stream`" in text
    report_md.update_doc(doc, [record("gpu-h200")])  # another tier joins; cpu stays
    report_md.update_doc(doc, [record("cpu", date="2026-02-02T00:00:00")])  # cpu replaced in place
    text = doc.read_text()
    assert text.count("<!-- pdsdk-matrix:cpu begin -->") == 1 and "<!-- pdsdk-matrix:gpu-h200 begin -->" in text
    assert "2026-02-02" in text and "2026-01-01T00:00:00: " in text  # the gpu section kept its date
    assert text.index("pdsdk-matrix:cpu begin") < text.index("pdsdk-matrix:gpu-h200 begin")



def test_chaos_section_names_the_run_it_comes_from():
    later = record("cpu", date="2026-02-02T00:00:00")
    del later["faults"]  # the later run has no chaos run: the section shows the earlier one's, and says so
    assert "`vllm/2P1D/nixl/redis` (run of 2026-01-01), 40 requests" in report_md.render([record("cpu"), later])


def test_compat_lists_versions_per_cell(tmp_path):
    doc = tmp_path / "compat.md"
    report_md.update_compat(doc, [record("cpu")])
    text = doc.read_text()
    assert "| cell | result | vllm | sglang | torch | nixl | mooncake |" in text
    row = next(line for line in text.splitlines() if line.startswith("| `vllm/1P1D/nixl/none`"))
    assert VERSIONS["vllm"] in row and VERSIONS["nixl"] in row and "works" in row
    assert "**fails**" in text and "not run" in text
    assert "`vllm/2P1D/nixl/redis` (faults) | chaos goal met (0/0/0)" in text


def test_merge_keeps_the_later_file_per_cell():
    a, b = record("cpu"), record("cpu", date="2026-03-03")
    b["cells"] = [c for c in b["cells"] if c["id"] == "vllm/1P1D/nixl/none"]
    b["cells"][0]["status"] = "failed"
    tier = by_tier([a, b])["cpu"]
    assert len(tier["cells"]) == len(a["cells"]) and len(tier["runs"]) == 2
    assert next(c for c in tier["cells"] if c["key"] == "vllm/1P1D/nixl/none")["status"] == "failed"


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_report_command_merges_files(tmp_path):
    for tier in ("cpu", "gpu"):
        (tmp_path / f"{tier}.json").write_text(json.dumps(record(tier)))
    done = run_cli("matrix", "report", str(tmp_path / "cpu.json"), str(tmp_path / "gpu.json"),
                   "--md", str(tmp_path / "m.md"), "--compat-md", str(tmp_path / "c.md"),
                   "--html", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert "pdsdk-matrix:gpu begin" in (tmp_path / "m.md").read_text()
    assert "pdsdk-matrix:cpu begin" in (tmp_path / "c.md").read_text()
    bad = run_cli("matrix", "report", str(tmp_path / "m.md"))
    assert bad.returncode == 2 and "matrix result" in bad.stderr


def test_html_is_self_contained_with_plots(tmp_path):
    page = report_html.render([record("cpu")])
    assert page.count("<svg") == 3 and "<table class=\"cells\">" in page
    for external in ("src=", "<link", 'href="http', "url(http", "@import"):
        assert external not in page  # nothing is fetched: XML namespace URIs are names, not requests
    assert "vllm/1P1D/local/memory" in page and "TTFT CDF" in page


@pytest.mark.slow  # starts a browser: the full suite's
def test_html_report_renders_in_headless_chromium(tmp_path):
    exe = chromium()
    if exe is None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)("chromium is not installed (make apt installs it)")
    path = report_html.write([record("cpu")], tmp_path / "report.html")
    assert_renders(exe, path, min_cells=4)
