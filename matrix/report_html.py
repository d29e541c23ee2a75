"""The HTML report of `pdsdk matrix`: one self-contained file (no CDN, no external file): the markdown
report's tables as HTML, and plots as inline SVG drawn by matplotlib: latency CDFs (TTFT, ITL, E2E)
per cell, per-cell bars, and TTFT vs ITL per request. A few lines of inline JS count what rendered
(`#render-check`), which the test reads back from headless Chromium.
"""

from __future__ import annotations

import html
import io
import re
from pathlib import Path
from typing import Any

import numpy as np

from pdsdk.errors import MissingDependency
from pdsdk.matrix import report_md
from pdsdk.matrix.results import by_tier

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1400px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}
figure{margin:1em 0;overflow-x:auto}figcaption{font-size:13px;color:#555}
pre{background:#f6f6f6;padding:.5em;font-size:12px;overflow-x:auto}
code{font-size:12px}.tier{border-top:3px solid #446;margin-top:2em}
#render-check{color:#888;font-size:12px}
"""

SCRIPT = """
(function(){var s=document.querySelectorAll('figure svg').length,
r=document.querySelectorAll('table.cells tbody tr').length;
document.getElementById('render-check').textContent='rendered: '+s+' plots, '+r+' cells';})();
"""


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise MissingDependency("the HTML report of `pdsdk matrix`", "matrix", e) from None
    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": .3,
                                "svg.hashsalt": "pdsdk"})
    import matplotlib.pyplot as plt

    return plt


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    _plt().close(fig)
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>", "", text[text.index("<svg"):], flags=re.S)  # date, creator
    return text


def series(cells: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(label, phase) for every measured phase of every cell that has one."""
    out = []
    for c in cells:
        for p in c.get("phases") or []:
            if any(r["ok"] for r in p.get("requests", [])):
                prefix = "" if c.get("group", "grid") == "grid" else f"{c['group']}:"
                out.append((prefix + c["id"] + ("" if p["label"] == "load" else f" [{p['label']}]"), p))
    return out


def cdf_plot(data: list[tuple[str, dict[str, Any]]]) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (title, pick) in zip(axes, (("TTFT", lambda r: [r["ttft_ms"]]), ("ITL", lambda r: r["itl_ms"]),
                                        ("E2E", lambda r: [r["e2e_ms"]]))):
        for label, p in data:
            values = np.sort([x for r in p["requests"] if r["ok"] for x in pick(r)])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label, lw=1.2)
        if title != "E2E":
            ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms{', log' if title != 'E2E' else ''})")
        ax.set_ylabel("fraction of " + ("tokens" if title == "ITL" else "requests"))
        ax.set_title(f"{title} CDF")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, .5))
    return _svg(fig)


def bar_plot(data: list[tuple[str, dict[str, Any]]]) -> str:
    plt = _plt()
    labels = [label for label, _ in data]
    s = [p["summary"] for _, p in data]
    y = np.arange(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.35 * len(labels) + 1.5), sharey=True)
    bars = (("TTFT mean", [x["ttft_ms"]["mean"] for x in s]), ("TTFT p99", [x["ttft_ms"]["p99"] for x in s]),
            ("ITL p99", [x["itl_ms"]["p99"] for x in s]), ("E2E mean", [x["e2e_ms"]["mean"] for x in s]))
    h = 0.8 / len(bars)
    for i, (name, values) in enumerate(bars):
        axes[0].barh(y + i * h - 0.4 + h / 2, np.nan_to_num(values), h, label=name)
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("ms")
    axes[0].set_title("latency per cell")
    axes[0].legend(fontsize=7)
    axes[1].barh(y, [x["output_throughput"] for x in s], 0.6, color="tab:green")
    axes[1].set_xlabel("output tokens/s")
    axes[1].set_title("throughput per cell")
    return _svg(fig)


def scatter_plot(data: list[tuple[str, dict[str, Any]]]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, p in data:
        ok = [r for r in p["requests"] if r["ok"] and r["itl_ms"]]
        if not ok:
            continue
        ttft = [r["ttft_ms"] for r in ok]
        itl = [float(np.mean(r["itl_ms"])) for r in ok]
        dots = ax.scatter(ttft, itl, s=8, alpha=.45, label=label)
        ax.scatter([p["summary"]["ttft_ms"]["mean"]], [p["summary"]["itl_ms"]["mean"]], s=90, marker="X",
                   color=dots.get_facecolor()[0][:3], edgecolor="k", linewidth=.6)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("mean ITL of the request (ms)")
    ax.set_title("TTFT vs ITL, one dot per request (X: the cell's mean)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, .5))
    return _svg(fig)


def md_to_html(text: str) -> str:
    """The subset report_md writes: headings, lists, pipe tables, fenced code, paragraphs, raw <details>."""
    out, lines, i = [], text.splitlines(), 0
    first_table = True
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip())[1:-1]])
                i += 1
            head, body = rows[0], [r for r in rows[2:]]
            cls = ' class="cells"' if first_table and head and head[0] == "cell" else ""
            first_table = first_table and not cls
            out.append(f"<table{cls}><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head)
                       + "</tr></thead><tbody>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body)
                       + "</tbody></table>")
            continue
        if line.startswith("```"):
            block = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                block.append(lines[i])
                i += 1
            out.append("<pre>" + html.escape("\n".join(block)) + "</pre>")
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("- "):
            out.append(f"<ul><li>{_inline(line[2:])}</li></ul>")
        elif line.startswith("<details>") or line.startswith("</details>"):
            out.append(line)
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
        i += 1
    return "\n".join(out)


def _inline(text: str) -> str:
    text = html.escape(text.replace("\\|", "|"), quote=False)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


def render(records: list[dict[str, Any]]) -> str:
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'><title>pdsdk matrix report</title>",
             f"<style>{STYLE}</style></head><body><h1>pdsdk matrix report</h1>",
             "<p id='render-check'>static</p>"]
    for name, tier in by_tier(records).items():
        parts.append(f"<section class='tier' data-tier='{html.escape(name)}'>")
        parts.append(md_to_html(report_md.tier_section(tier)))
        data = series(tier["cells"])
        if data:
            parts.append("<h4>Plots</h4>")
            for title, fn in (("Latency CDFs (every measured phase)", cdf_plot),
                              ("Per-cell latencies and throughput", bar_plot),
                              ("TTFT vs ITL per request", scatter_plot)):
                parts.append(f"<figure data-plot='{fn.__name__}'>{fn(data)}<figcaption>{title}</figcaption></figure>")
        parts.append("</section>")
    parts.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(parts)


def write(records: list[dict[str, Any]], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(records))
    return path
