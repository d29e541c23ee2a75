"""Markdown reports of `pdsdk matrix`: the cell table, the seed article's tables, the chaos run and the
failures, one section per tier; and the compatibility table (versions each cell ran with).

Each tier's section sits between `<!-- pdsdk-matrix:TIER begin -->` and `... end -->` markers, so
`update_doc` replaces only the tiers it has results for and keeps everything else in the file: a GPU
run's rows join docs/matrix.md next to the CPU tier's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pdsdk.matrix.results import by_tier

COMPONENTS = ("vllm", "sglang", "torch", "nixl", "mooncake", "redis", "lmcache", "pdsdk", "python", "device")


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def phase(cell: dict[str, Any], label: str | None = None) -> dict[str, Any] | None:
    phases = cell.get("phases") or []
    if label is None:
        return phases[-1] if phases else None
    return next((p for p in phases if p["label"] == label), None)


def correct_text(cell: dict[str, Any]) -> str:
    c = cell.get("correctness")
    if not c:
        return "-"
    text = f"{c['equal']}/{c['expected']}"
    if not c.get("exact", True):
        text += " (not required)"
    return text if c.get("ok") else f"**{text}**"


def transfer_text(cell: dict[str, Any]) -> tuple[str, str]:
    m = cell.get("metrics") or {}
    t = m.get("transfer") or {}
    if not t.get("transfers") and not t.get("failed"):
        return "-", "-"
    moved = f"{t['transfers']} ({t['bytes'] / 2**20:.1f} MiB"
    moved += f", {t['gbps']} GB/s)" if t.get("gbps") else ")"
    if t.get("failed"):
        moved += f", {t['failed']} failed"
    return moved, ", ".join(t.get("paths") or []) or "-"


def store_text(cell: dict[str, Any]) -> str:
    s = (cell.get("metrics") or {}).get("store")
    if not s:
        return "-"
    keys = [k for k in ("hits", "misses", "puts", "errors") if k in s]
    return ", ".join(f"{k} {int(s[k])}" for k in keys) or "-"


CELL_COLUMNS = ("cell", "status", "greedy = baseline", "TTFT mean ms", "TTFT p99 ms", "ITL p99 ms", "E2E mean ms",
                "out tok/s", "KV transfers", "transfer path", "store", "note")


def cell_row(cell: dict[str, Any]) -> list[str]:
    p = phase(cell, "load") or phase(cell)
    s = p["summary"] if p else None
    moved, path = transfer_text(cell)
    status = {"ok": "ok", "failed": "**failed**", "skipped": "skipped"}[cell["status"]]
    note = cell.get("reason") or ""
    if s and s.get("errors"):
        note = (note + "; " if note else "") + f"{s['errors']} of {s['requests']} requests failed"
    return [f"`{cell['id']}`", status, correct_text(cell),
            _f(s["ttft_ms"]["mean"]) if s else "-", _f(s["ttft_ms"]["p99"]) if s else "-",
            _f(s["itl_ms"]["p99"]) if s else "-", _f(s["e2e_ms"]["mean"]) if s else "-",
            _f(s["output_throughput"]) if s else "-", moved, path, store_text(cell), _escape(note)]


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:220]


def table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def versions_line(run: dict[str, Any]) -> str:
    v = run.get("versions") or {}
    parts = [f"{k} {v[k]}" for k in ("vllm", "sglang", "torch", "nixl", "mooncake") if v.get(k)]
    return ", ".join(parts + [f"pdsdk {run.get('pdsdk')}", f"Python {v.get('python')}"])


# --- the seed article's tables -------------------------------------------------------------------

def _seed_cell(cells: list[dict], topology: str, tp: int = 1, variant: str = "", scenario: str = "") -> dict | None:
    for c in cells:
        if c.get("group") == "seed" and c["topology"] == topology and c["tp"] == tp and c["variant"] == variant \
                and c.get("scenario", "") == scenario:
            return c
    return None


def _metric(cell: dict | None, label: str, key: str, sub: str | None) -> str:
    if cell is None:
        return "-"
    if cell["status"] == "skipped":
        return "skipped"
    p = phase(cell, label)
    if p is None:
        return "failed" if cell["status"] == "failed" else "-"
    s = p["summary"]
    if key == "cache_hit":
        rate = (p.get("prefix_cache") or {}).get("hit_rate")
        return "-" if rate is None else f"{rate * 100:.0f}%"
    if key == "itl_max":
        values = [x for r in p.get("requests", []) if r["ok"] for x in r["itl_ms"]]
        return _f(max(values)) if values else "-"
    return _f(s[key] if sub is None else s[key][sub])


SEED_METRICS = [("Output tok/s", "output_throughput", None), ("Mean TTFT ms", "ttft_ms", "mean"),
                ("Mean E2E ms", "e2e_ms", "mean"), ("P95 ITL ms", "itl_ms", "p95"), ("P99 ITL ms", "itl_ms", "p99")]


def seed_tables(cells: list[dict]) -> str:
    seed = [c for c in cells if c.get("group") == "seed"]
    if not seed:
        return ""
    single, tp2 = _seed_cell(seed, "single"), _seed_cell(seed, "single", tp=2)
    pd = next((c for c in seed if c["topology"] == "1P1D"), None)
    out = ["#### Seed tables (the article's Results 1-3 and 5, this machine's scale)", ""]
    skipped = [c for c in seed if c["status"] == "skipped"]
    for label, title in (("low", "Results 1: low load"), ("high", "Results 2: high load")):
        p = phase(pd or single or {}, label) if (pd or single) else None
        out += [f"{title}" + (f" ({p['describe']}, {p['phase']['rate']} req/s)" if p else ""), ""]
        header = ["metric", "single", "TP=2", f"PD 1P1D ({pd['transport']})" if pd else "PD 1P1D"]
        rows = [[name] + [_metric(c, label, key, sub) for c in (single, tp2, pd)] for name, key, sub in SEED_METRICS]
        out += [table(header, rows), ""]
    cache = _seed_cell(seed, "single", scenario="prefix-cache")
    if cache:
        p = phase(cache, "cold")
        out += ["Results 3: prefix cache (the same prompts cold, warm, then after a flush)"
                + (f" ({p['describe']})" if p else ""), ""]
        rows = [[name] + [_metric(cache, lab, key, sub) for lab in ("cold", "warm", "flush")]
                for name, key, sub in (("Mean TTFT ms", "ttft_ms", "mean"), ("P99 TTFT ms", "ttft_ms", "p99"),
                                       ("Max ITL ms", "itl_max", None),
                                       ("prefix cache hits (prompt tokens)", "cache_hit", None))]
        out += [table(["metric", "cold", "warm", "flush"], rows), ""]
    chunk, fp8 = _seed_cell(seed, "single", variant="chunked-off"), _seed_cell(seed, "single", variant="fp8-kv")
    out += ["Results 5: ablations on the single engine (low load)", ""]
    rows = [[name] + [_metric(c, "low", key, sub) for c in (single, chunk, fp8)] for name, key, sub in SEED_METRICS]
    out += [table(["metric", "default", "chunked prefill off", "FP8 KV (fp8_e5m2)"], rows), ""]
    if skipped:
        out += ["Not run here: " + "; ".join(f"`{c['id']}`: {c['reason']}" for c in skipped), ""]
    out += ["Results 4 is Results 1-2 with a larger `--model` (the article: Qwen2.5-32B on 2 GPUs).", ""]
    return "\n".join(out)


# --- chaos -----------------------------------------------------------------------------------------

def faults_section(f: dict[str, Any] | None) -> str:
    if not f:
        return ""
    exact = f.get("exact", True)
    verdict = ("**0 / 0 / 0**" if exact else "**0 / - / 0** (outputs not judged)") if f.get("ok") else "**not met**"
    control = not (f.get("options") or {}).get("kinds", True)
    day = str((f.get("run") or {}).get("date") or "")[:10]  # merged tiers: the chaos run may be an older run's
    out = ["#### Chaos run" + (" (control: the same load, no faults injected)" if control else ""), "",
           f"`{f.get('cell', '?')}`" + (f" (run of {day})" if day else "")
           + f", {f.get('requests')} requests at {f.get('rate')}/s, deadline {f.get('deadline_s')} s"
           + (f", machine load average {f['loadavg_1m']} at the end" if f.get("loadavg_1m") is not None else "")
           + "; " f"faults: {', '.join(f'{k} x{v}' for k, v in (f.get('fault_counts') or {}).items()) or 'none injected'}.", "",
           table(["requests", "completed", "lost before the first token", "cut mid-stream", "wrong outputs",
                  "past deadline", "goal 0/0/0", "router retries", "client retries"],
                 [[str(f.get("requests")), str(f.get("completed")), str(f.get("lost")), str(f.get("cut", "-")),
                   f"{f.get('wrong')}" + ("" if f.get("exact", True) else " (not judged: no batch-invariant mode)"),
                   str(f.get("late")), verdict, _f(f.get("router_retries"), 0), str(f.get("client_retries", "-"))]]),
           ""]
    kinds = fault_rows(f.get("events") or [])
    if kinds:
        out += [table(["fault", "injected", "targets", "healthy again after (s)"], kinds), ""]
    if f.get("error"):
        out += [f"Run error: {_escape(f['error'])}", ""]
    if f.get("lost_reasons"):
        out += ["Lost requests: " + "; ".join(f"`{_escape(r)[:160]}`" for r in f["lost_reasons"]), ""]
    if f.get("cut_reasons"):
        out += ["Cut streams: " + "; ".join(f"`{_escape(r)[:160]}`" for r in f["cut_reasons"]), ""]
    for w in f.get("wrong_examples") or []:
        out += [f"{'Wrong' if exact else 'Different'} output: request {w['index']} differs from token {w['position']} "
                f"(lengths {w['lengths'][0]} vs {w['lengths'][1]}): expected `{w['expected']}`, got `{w['got']}`", ""]
    t = f.get("transfer") or {}
    if t:
        out += [f"Transfers during the run: {t.get('transfers')} done, {t.get('failed')} failed"
                + (f" ({', '.join(f'{k}: {v}' for k, v in t['failures'].items())})" if t.get("failures") else "")
                + f"; store: {', '.join(f'{k} {v}' for k, v in (f.get('store') or {}).items() if k in ('hits', 'misses', 'puts', 'errors'))}.", ""]
    events = [e for e in f.get("events") or () if "skipped" not in e.get("note", "")]
    if events:
        skipped = len(f["events"]) - len(events)
        out += ["Fault timeline (s from the start of the load): "
                + "; ".join(f"{e['t']:.0f} {e['kind']} {e['target']}" + (f" ({e['note']})" if e.get("note") else "")
                            for e in events[:30])
                + (f"; {skipped} more not injected (a process was already down, or none of its role would have "
                   "been left)." if skipped else "."), ""]
    return "\n".join(out)


def fault_rows(events: list[dict[str, Any]]) -> list[list[str]]:
    """One row per fault kind: times injected, targets, and for kills how long until the killed
    process was healthy again (its `restarted` event)."""
    rows: dict[str, list] = {}
    for i, e in enumerate(events):
        if e["kind"] == "restarted" or "skipped" in e.get("note", ""):
            continue
        row = rows.setdefault(e["kind"], [0, set(), []])
        row[0] += 1
        row[1].add(e["target"])
        back = next((b for b in events[i + 1:] if b["kind"] == "restarted" and b["target"] == e["target"]), None)
        if e["kind"].startswith("kill_") and back is not None:
            row[2].append(f"{back['t'] - e['t']:.0f}")
    return [[f"`{kind}`", str(n), ", ".join(sorted(targets)), ", ".join(backs) or "-"]
            for kind, (n, targets, backs) in rows.items()]


# --- whole sections -------------------------------------------------------------------------------

def tier_section(tier: dict[str, Any]) -> str:
    cells = tier["cells"]
    grid = [c for c in cells if c.get("group", "grid") == "grid"]
    runs = tier["runs"]
    head = [f"### Tier `{tier['tier']}`", ""]
    for run in runs:
        took = f", took {run['duration_s'] / 60:.1f} min" if run.get("duration_s") else ""
        head.append(f"- {run.get('date')}: {run.get('machine')}; model `{Path(str(run.get('model'))).name}`; "
                    f"{versions_line(run)}{took}")
    head.append("")
    ok = sum(c["status"] == "ok" for c in cells)
    failed = sum(c["status"] == "failed" for c in cells)
    skipped = sum(c["status"] == "skipped" for c in cells)
    head += [f"{ok} ok, {failed} failed, {skipped} not run here.", ""]
    body = []
    if grid:
        p = next((phase(c, "load") for c in grid if phase(c, "load")), None)
        body += ["#### Cells" + (f" ({p['describe']}, {p['phase']['rate']} req/s)" if p else ""), "",
                 table(CELL_COLUMNS, [cell_row(c) for c in grid]), ""]
    for extra in (seed_tables(cells), faults_section(tier.get("faults"))):
        if extra:
            body += [extra, ""]
    failures = [c for c in cells if c["status"] == "failed"]
    if failures:
        body += ["#### Failures", ""]
        for c in failures:
            load = f" (load average {c['loadavg_1m']})" if c.get("loadavg_1m") is not None else ""
            body.append(f"<details><summary><code>{c['key']}</code>{load}: {_html(c['reason'])}</summary>\n")
            for name, lines in (c.get("log_tail") or {}).items():
                body += [f"{name}:", "```", *[line[:200] for line in lines[-15:]], "```"]
            body.append("</details>\n")
    return "\n".join(head + body).replace("\n\n\n", "\n\n")


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")[:300]


def render(records: list[dict[str, Any]]) -> str:
    return "\n".join(tier_section(t) for t in by_tier(records).values())


def compat_section(tier: dict[str, Any]) -> str:
    rows = []
    for c in tier["cells"]:
        v = c["run"].get("versions") or {}
        status = {"ok": "works", "failed": "**fails**", "skipped": "not run"}[c["status"]]
        check = c.get("correctness") or {}
        if c["status"] == "ok" and check and check["equal"] < check["expected"]:
            status += f" (greedy {check['equal']}/{check['expected']} equal: not required here)"
        rows.append([f"`{c['id']}`" + (f" ({c['group']})" if c.get("group", "grid") != "grid" else ""), status,
                     *[str(v.get(k) or "-") for k in COMPONENTS], c["run"].get("date") or "-"])
    f = tier.get("faults")
    if f:
        v = f["run"].get("versions") or {}
        met = "chaos goal met (0/0/0)" if f.get("exact", True) else "chaos: 0 lost, 0 late (outputs not judged)"
        status = met if f.get("ok") else \
            f"**chaos goal not met**: lost {f.get('lost')}, wrong {f.get('wrong')}, late {f.get('late')}"
        rows.append([f"`{f.get('cell')}` (faults)", status, *[str(v.get(k) or "-") for k in COMPONENTS],
                     f["run"].get("date") or "-"])
    machines = "; ".join(sorted({str(r.get("machine")) for r in tier["runs"]}))
    return "\n".join([f"### Tier `{tier['tier']}` ({machines})", "",
                      table(["cell", "result", *COMPONENTS, "date"], rows), ""])


def replace_section(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- pdsdk-matrix:{name} begin -->", f"<!-- pdsdk-matrix:{name} end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text)
    return text.rstrip() + "\n\n" + block + "\n"


MATRIX_HEAD = """# `pdsdk matrix` results

Generated by `pdsdk matrix` (what a cell is and how it runs: docs/matrix.md in the pdsdk repository);
one section per tier. Regenerate a tier with `make matrix` (CPU) or merge results files with
`pdsdk matrix report results*.json --md docs/matrix.md`.
"""

COMPAT_HEAD = """# Compatibility matrix

Generated by `pdsdk matrix ... --compat-md docs/compat.md` (or `pdsdk matrix report results*.json
--compat-md docs/compat.md`): every cell with the engine and library versions its workers ran with
(read with importlib.metadata by the workers' own Python). "works": the cell started, its greedy outputs
equal a single engine's token for token, and its load completed without errors.
"""


def update_doc(path: str | Path, records: list[dict[str, Any]]) -> None:
    _update(Path(path), MATRIX_HEAD, tier_section, records)


def update_compat(path: str | Path, records: list[dict[str, Any]]) -> None:
    _update(Path(path), COMPAT_HEAD, compat_section, records)


def _update(path: Path, head: str, section, records: list[dict[str, Any]]) -> None:
    """Replace each tier's section of `path` (created with `head`), leaving the other tiers alone."""
    text = path.read_text() if path.exists() else head
    for name, tier in by_tier(records).items():
        text = replace_section(text, name, section(tier))
    path.write_text(text if text.endswith("\n") else text + "\n")
